"""`sim.profile_drift=run_probe`: the profile scaled to the machine as the measured run found it.

A shared CPU host drifts: the same forward took 24.7 ms and 31.0 ms within one calibration,
and a probe timed in the predicting process minutes after a run says little about
the processes that ran it (per-process page placement, the other core's load then). Every real
run therefore times fixed probe forwards of each role's model — one token at slot
``FORWARD_PROBE_CONTEXT`` (the target also 2, 3, 4 and 8 tokens), on the run's own devices and
processes, just before it decodes
(real/calibrate/probe_forward.py: ``probe_target_s``, ``probe_draft_s``). The probe does not depend on the
configuration's schedule, γ, tree, lookahead or prompts, and no time of the run's decoding is
used: it is the short probe "measured just before" that issue 15 allows, taken where the
measurement is taken.

A prediction with ``run_probe`` finds the real run of its own experiment (the same experiment
key and prompt split, and for DSD the same links and τ) among the runs of
``acceptance.trace_path`` — in `+sweep=validate` the measure role of the same grid point — and
scales each role's profile times by (its probe) / (the profile's time for the probe's own shape:
one token at that slot, chain-shaped, at the role's TP degree, alone). Each model is probed at
one and at ``FORWARD_PROBE_TOKENS`` tokens, the target also at the small verification sizes
``FORWARD_PROBE_SMALL_K``: a bandwidth-bound one-token forward and a partly compute-bound
verification drift by different amounts on a shared host (+40 % against +27 % within one run),
and the shape between them moves too (a 3-token verification took 1.40 one-token forwards in a
profile and 1.50 in runs five hours later: every γ = 2 prediction 10–13 % too fast), so a
factor for a forward over k tokens is the probe's at a probed size and log-linear in k between
them (``factor_at``). The profile keeps the shape in context, TP degree and
contention; the level is the machine's at the run. The n-gram draft (no forward) takes the
target's factor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from testbed.config import ConfigError, ExperimentConfig
from testbed.machine import FORWARD_PROBE_SMALL_K, FORWARD_PROBE_TOKENS
from testbed.metrics import experiment_key
from testbed.results import run_split
from testbed.schedules import spec_of

FIELDS = {"target": "probe_target_s", "target_k8": "probe_target_k8_s", "draft": "probe_draft_s",
          "draft_k8": "probe_draft_k8_s",
          "draft_pair": "probe_draft_pair_s",
          **{f"target_k{k}": f"probe_target_k{k}_s" for k in FORWARD_PROBE_SMALL_K}}
HOWTO = ("runs made before the probes existed lack it: run the measurement again (`+sweep=validate` runs "
         "it before each prediction), or use sim.profile_drift=forward")


def _same_point(s: dict[str, Any], exp: ExperimentConfig) -> bool:
    """The run measured this experiment: key fields, and for DSD its links and relaxation."""
    key = experiment_key(exp)
    for k, v in key.items():
        if k == "backend":
            continue
        if k == "temperature":
            if float(s.get(k, -1)) != float(v):
                return False
        elif s.get(k) != v:
            return False
    if spec_of(exp).pipelined:
        tau = exp.schedule.tau if exp.schedule.adaptive else 0.0
        return (float(s.get("latency_ms") or 0.0) == float(exp.network.latency_ms)
                and float(s.get("tau") or 0.0) == float(tau))
    return True


def measured_run(exp: ExperimentConfig) -> tuple[Path, dict[str, Any]]:
    """The newest real run of ``exp``'s experiment on ``exp``'s prompt split that recorded the
    probe, below ``acceptance.trace_path``; ConfigError naming the setting when there is none."""
    raw = exp.acceptance.trace_path
    root = Path(raw or "").expanduser()
    if not raw or not root.exists():
        raise ConfigError("acceptance.trace_path", raw, "a directory holding the real run of this "
                          "experiment (sim.profile_drift=run_probe scales by its probe)")
    found = []
    for f in ([root / "summary.json"] if (root / "summary.json").exists() else root.rglob("summary.json")):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # a damaged run is not this one's measurement (the trace reader names it)
        if (s.get("backend") == "real" and FIELDS["target"] in s and _same_point(s, exp)
                and run_split(f.parent, s) == exp.workload.split):
            found.append((f.stat().st_mtime, f.parent, s))
    if not found:
        raise ConfigError("sim.profile_drift", "run_probe",
                          f"a real run of this experiment (schedule {experiment_key(exp)['schedule']}, "
                          f"pair {exp.pair.name}, split {exp.workload.split}) with its probe forward "
                          f"below {raw}; {HOWTO}")
    _, run_dir, summary = max(found, key=lambda x: x[0])
    return run_dir, summary


def drift_factors(exp: ExperimentConfig, modelled_probe: dict[str, float | None]
                  ) -> tuple[dict[str, float], Path, dict[str, Any]]:
    """Per probe (``target``, ``target_k2``…, ``target_k8``, ``draft``, ``draft_k8``): the
    measured run's probe over the profile's time for it (``modelled_probe``: probe -> seconds,
    None for a model without such a forward); the run it came from and its summary. A draft without a
    forward takes the target's factors; a missing eight-token probe, the role's one-token factor;
    a missing small-k probe (a run recorded before them, DSD's stages) is left out."""
    run_dir, s = measured_run(exp)
    out: dict[str, float] = {}
    for probe, modelled in modelled_probe.items():
        measured = s.get(FIELDS[probe])
        if modelled and measured:
            out[probe] = float(measured) / modelled
    if "target" not in out:
        raise ConfigError("sim.profile_drift", "run_probe", f"a run whose target probe is positive "
                          f"({run_dir} has {s.get(FIELDS['target'])!r})")
    draft = out.get("draft")
    small = {p: f for p, f in out.items() if p.startswith("target_k") and p != "target_k8"}
    return {"target": out["target"], "target_k8": out.get("target_k8", out["target"]), **small,
            "draft": out["target"] if draft is None else draft,
            "draft_k8": out.get("draft_k8", out.get("target_k8", out["target"]) if draft is None else draft)}, run_dir, s


def warm_step_ratio(summary: dict[str, Any]) -> float:
    """A draft step right after a draft step over one alone, as the measured run's probe found
    them: two draft forwards back to back (``probe_draft_pair_s``) against one after the
    target's forwards (``probe_draft_s``). On a CPU the target's forward streams its weights
    through the caches; the next draft forward finds none of the draft's there, a following one
    finds some (the bundled draft's real rounds: ~2.5 ms a step after the first, where the
    profile's table, timed alone, says 3.1). 1 without both."""
    pair, one = summary.get(FIELDS["draft_pair"]), summary.get(FIELDS["draft"])
    if not pair or not one:
        return 1.0
    return float(pair) / (2.0 * float(one))


def probe_points(factors: dict[str, float], role: str) -> dict[int, float]:
    """A role's factors by forward size: one token, the small verification sizes it was probed
    at, ``FORWARD_PROBE_TOKENS``."""
    points = {1: factors[role], FORWARD_PROBE_TOKENS: factors[f"{role}_k{FORWARD_PROBE_TOKENS}"]}
    for k in FORWARD_PROBE_SMALL_K:
        if f"{role}_k{k}" in factors:
            points[k] = factors[f"{role}_k{k}"]
    return points


def factor_at(tokens: int, points: dict[int, float]) -> float:
    """A role's drift factor for a forward over ``tokens``: the probe's at a probed size,
    log-linear in k between the nearest probed sizes, the end's beyond them (a forward turns
    from bandwidth-bound to partly compute-bound as k grows, and each size drifts its own way)."""
    ks = sorted(points)
    if tokens <= ks[0]:
        return points[ks[0]]
    if tokens >= ks[-1]:
        return points[ks[-1]]
    hi = next(k for k in ks if k >= tokens)
    lo = max(k for k in ks if k <= tokens)
    if hi == lo:
        return points[lo]
    w = math.log(tokens / lo) / math.log(hi / lo)
    return points[lo] + (points[hi] - points[lo]) * w
