"""`sim.profile_drift`: the profile's level set to the machine's (sim/cost/profile.py's ProfileCost).

- ``none``: the profile as measured.
- ``probe``: every time scaled by the profile's copy-bandwidth probe over the same probe now
  (testbed/machine.py).
- ``forward``: each model's times scaled by its probe forward timed now, in the predicting
  process, over the same probe in the profile (real/calibrate/probe_forward.py).
- ``run_probe``: each model's times scaled to the probe forwards the measured real run of the
  same experiment timed in its own processes before its requests (sim/cost/run_probe.py); per
  forward size: a forward over a probed size (1, the target's ``FORWARD_PROBE_SMALL_K``,
  ``FORWARD_PROBE_TOKENS``) takes that probe's factor, the last one's beyond, log-linearly in
  k between probed sizes — on a
  shared host a bandwidth-bound one-token forward and a partly compute-bound verification (or
  a draft's tree expansion) drift by different amounts (+40 % against +27 % in one run; a
  draft's one-token probe +32 % while its 8-leaf expansions did not move).

Sets on the cost model: ``drift_by_role`` (the one-token factor per role), ``drift`` (the
target's), ``scale`` (multiplied by them), and for run_probe ``k_factor(role, tokens)`` in
their place, ``drift_run`` (the run it came from) and ``drift_k8`` (the target's factor at
``FORWARD_PROBE_TOKENS``).
"""

from __future__ import annotations

from typing import Any

from sim.cost.profile_tables import CALIBRATE_CMD
from testbed.config import ConfigError, ExperimentConfig
from testbed.machine import FORWARD_PROBE_SMALL_K, FORWARD_PROBE_TOKENS


def apply_profile_drift(cost: Any, exp: ExperimentConfig) -> None:
    cost.drift_by_role = {"target": 1.0, "draft": 1.0}
    cost.k_factor = None
    mode = exp.sim.profile_drift
    if mode == "probe":
        cost.drift_by_role = dict.fromkeys(cost.scale, _bandwidth_drift(cost))
    elif mode == "forward":
        cost.drift_by_role = _forward_drift(cost, exp)
    elif mode == "run_probe":
        _run_probe_drift(cost, exp)
    cost.drift = cost.drift_by_role["target"]
    if cost.k_factor is None:
        cost.scale = {role: v * cost.drift_by_role[role] for role, v in cost.scale.items()}


def _run_probe_drift(cost: Any, exp: ExperimentConfig) -> None:
    from sim.cost.run_probe import drift_factors, factor_at, probe_points, warm_step_ratio

    n = FORWARD_PROBE_TOKENS
    modelled = {"target": cost.probe_seconds("target"), "target_k8": cost.probe_seconds("target", n),
                **{f"target_k{k}": cost.probe_seconds("target", k) for k in FORWARD_PROBE_SMALL_K},
                "draft": cost.probe_seconds("draft") if "draft" in cost._forward else None,
                "draft_k8": cost.probe_seconds("draft", n) if "draft" in cost._forward else None}
    factors, cost.drift_run, summary = drift_factors(exp, modelled)
    cost.warm_draft = warm_step_ratio(summary)
    cost.drift_by_role = {"target": factors["target"], "draft": factors["draft"]}
    cost.drift_k8 = factors["target_k8"]
    points = {role: probe_points(factors, role) for role in ("target", "draft")}
    cost.k_factor = lambda role, k: factor_at(k, points[role])


def _forward_drift(cost: Any, exp: ExperimentConfig) -> dict[str, float]:
    from testbed.backends import hook
    from testbed.machine import forward_drift_factors

    recorded = cost.profile.get("probe", {}).get("forward_s") or {}
    probed = [cost.names["target"]] + ([] if cost.ar or cost.kinds["draft"] == "ngram" else [cost.names["draft"]])
    missing = [n for n in probed if n not in recorded]
    if missing:
        raise ConfigError("sim.profile_drift", "forward",
                          f"none or probe: the profile {cost.path} has no forward probe of "
                          f"{', '.join(missing)} (measured before this version, or without that model); "
                          f"re-measure it with `{CALIBRATE_CMD}`")
    probe = hook("probe_forward")
    if probe is None:
        raise ConfigError("sim.profile_drift", "forward", "none: the forward probe needs the real backend")
    roles = {"target": cost.names["target"], "draft": cost.names["draft"]}
    return forward_drift_factors(recorded, probe(exp), roles)


def _bandwidth_drift(cost: Any) -> float:
    from testbed.machine import drift_factor, probe_now

    probe = cost.profile.get("probe", {})
    if not probe.get("gbps"):
        raise ConfigError("sim.profile_drift", "probe",
                          f"none: the profile {cost.path} has no bandwidth probe (measured before "
                          f"this version); re-measure it with `{CALIBRATE_CMD}`")
    return drift_factor(float(probe["gbps"]), probe_now())
