"""The models' own speed, now: a short probe that does not depend on the configuration.

On a shared CPU host the level of every forward drifts by ±20 % between runs an hour apart,
and a memory-bandwidth probe does not follow it (two calibrations 90 minutes apart: the
target's forward 20 % faster, the copy bandwidth 2 % slower). What does follow it is the
forward itself. This probe times one fixed forward per transformer model of the pair — one
token, greedy, at slot ``PROBE_CONTEXT`` — the same way in the calibration (stored in the
profile as ``probe.forward_s``) and just before a prediction (``sim.profile_drift=forward``):
the ratio is the machine's drift, per model. It never runs the configuration being predicted
(its schedule, γ, tree, placement or prompts), only the models' forward at one shape.

The n-gram draft has no forward (its proposals are microseconds of Python); it takes the
target's factor. Models stay loaded in the process (a sweep's predictions probe again and
again), and a reading is reused for ``REUSE_S`` seconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from real.model.runners import sync_device
from testbed.config import ExperimentConfig, ModelConfig, real_dtype
from testbed.machine import FORWARD_PROBE_CONTEXT, FORWARD_PROBE_SMALL_K, FORWARD_PROBE_TOKENS
from testbed.schedules import spec_of

PROBE_CONTEXT = FORWARD_PROBE_CONTEXT  # slot of the probed token
PROBE_TOKENS = FORWARD_PROBE_TOKENS  # the target's second probe: a verification-sized forward
WARMUP = 3
REPEATS = 30  # interleaved over the models: ~1 s for the bundled pair on one core
REUSE_S = 30.0

ProbeFns = dict[str, Callable[[], Any]]


def probe_functions(exp: ExperimentConfig, target: Any, tokenizer: Any,
                    drafts: list[ModelConfig]) -> ProbeFns:
    """One zero-argument forward per model, by model name: the target's (``exp.pair.target``)
    and each of ``drafts`` that has a forward (its own model or an early exit)."""
    from real.calibrate.drafts import make_draft as _make_draft
    from real.model.runners import TargetRunner
    from testbed.spec.sampling import SamplingParams

    if target.max_seq < PROBE_CONTEXT + 2:
        target.setup_cache(PROBE_CONTEXT + 2)
    runner = TargetRunner(target, SamplingParams())
    fns: ProbeFns = {exp.pair.target.name: lambda: runner.probs([1], PROBE_CONTEXT)}
    for d in drafts:
        if d.kind == "ngram" or not d.name:
            continue
        draft = _make_draft(exp, d, target, tokenizer, params=SamplingParams())
        model = getattr(draft, "model", None)
        if model is not None and model.max_seq < PROBE_CONTEXT + 2:
            model.setup_cache(PROBE_CONTEXT + 2)
        fns[d.name] = lambda draft=draft: draft.forward_probs([1], PROBE_CONTEXT)
    return fns


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (sysfs), 32 MB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG") or 0) * unit)
    return max(sizes, default=32 << 20)


_EVICT: list[torch.Tensor] = []


def evict_caches() -> None:
    """Reads twice the last-level cache, so that the next call finds none of its weights cached.

    A probe's ratio to the profile is the machine's drift only if both find the caches alike.
    The profile times its probes in random order, mostly after a target forward that streamed
    every cached line out: a small draft (the bundled one reads ~1.6 ms cold) is timed cold. In a
    run's own processes it was not: where the draft's process holds a pipeline's first stage or
    nothing else (`decentralized`, `async`), its probe read 1.27-1.30 ms against 1.65 ms in
    `sync`'s, and the drift factor 0.68-0.89 made the predicted draft 20-30 % faster than the
    run's own steps, which follow the target's. Before each draft probe (``time_functions``'
    ``cold``, the profile's cold probes), on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return  # a GPU's models do not live in the CPU's caches
    if not _EVICT:
        _EVICT.append(torch.ones(2 * last_level_cache_bytes() // 4))
    _EVICT[0].sum()


def time_functions(fns: ProbeFns, *, repeats: int = REPEATS, warmup: int = WARMUP,
                   align: Callable[[], Any] | None = None, cold: Collection[str] = ()) -> dict[str, float]:
    """Median seconds per call of each function, the calls interleaved (a burst of load hits
    every model alike); those named in ``cold`` (the draft's) each after ``evict_caches``, as the
    profile times them. The target's are not: its tables time its forwards as a run makes them,
    back to back, with its activations and KV cache warm (evicted, its probe read ~5 % slower than
    its tables, a drift that was not the machine's). ``align``, called before each call and not
    timed: a tensor-parallel group's barrier, so that every rank starts the forward together
    (see ``RunProbe``)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode():
        for i in range(warmup + repeats):
            for name, fn in fns.items():
                if name in cold:
                    evict_caches()
                if align is not None:
                    align()
                sync_device()
                t = time.perf_counter()
                fn()
                sync_device()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t)
    return {name: round(statistics.median(ts), 7) for name, ts in times.items()}


_models: dict[tuple, ProbeFns] = {}
_readings: dict[tuple, tuple[float, dict[str, float]]] = {}


def forward_probe(exp: ExperimentConfig) -> dict[str, float]:
    """Median seconds of the probe forward per transformer model of ``exp``'s pair, measured
    now with ``real.threads`` intra-op threads (the profile's setting) — or reused from a
    reading less than ``REUSE_S`` seconds old."""
    from real.model.weights import load_model
    from real.runtime.loading import DTYPES, attach_graphs, model_device
    from testbed.paths import repo_path

    t, d = exp.pair.target, exp.pair.draft
    key = (t.name, str(t.path), d.name, d.kind, str(d.path), not spec_of(exp).drafts,
           real_dtype(exp), exp.real.threads)
    if key in _readings and time.monotonic() - _readings[key][0] < REUSE_S:
        return _readings[key][1]
    old_threads = torch.get_num_threads()
    if exp.real.threads:
        torch.set_num_threads(exp.real.threads)
    try:
        if key not in _models:
            target, tokenizer = load_model(None if t.path is None else repo_path(t.path),
                                           dtype=DTYPES[real_dtype(exp)], device=model_device(exp),
                                           max_seq=PROBE_CONTEXT + 2)
            attach_graphs(target, exp.real.cuda_graphs)
            _models.clear()  # one pair's models at a time
            drafts = [d] if spec_of(exp).drafts else []
            _models[key] = probe_functions(exp, target, tokenizer, drafts)
        reading = time_functions(_models[key], cold=[m for m in _models[key] if m != t.name])
    finally:
        torch.set_num_threads(old_threads)
    _readings[key] = (time.monotonic(), reading)
    return reading



# ------------------------------------------------------------------- in a run's own processes
RUN_REPEATS = 4  # per reading: median of 4 after 1 warm-up (~1 s for the bundled pair)
MAX_READINGS = 8  # per run: before every request, or every n-th of a long prompt set
PROBE_FIELDS = {"target": "probe_target_s", "target_k8": "probe_target_k8_s", "draft": "probe_draft_s",
                "draft_k8": "probe_draft_k8_s", "draft_pair": "probe_draft_pair_s",
                **{f"target_k{k}": f"probe_target_k{k}_s" for k in FORWARD_PROBE_SMALL_K}}


class RunProbe:
    """Summary fields ``probe_target_s`` / ``probe_target_k8_s`` / ``probe_draft_s``: the probe
    forwards of each role's model — one token at slot ``PROBE_CONTEXT`` (and, for the target,
    ``FORWARD_PROBE_SMALL_K`` and ``PROBE_TOKENS`` tokens there too: ``probe_target_k<k>_s``),
    standardized at the run's sampling settings — timed by a
    real run in its own processes on its own devices just before the requests it decodes (every
    one, or every n-th of more than ``MAX_READINGS``; under load, where requests overlap, before
    serving and after the last answer) and averaged: the machine as this run found
    it (``sim.profile_drift=run_probe`` scales a prediction of the run by them). On this host the
    level of a two-process forward moved by 15 % within one 20 s run, so one reading before the
    first request did not follow the run it stood for; and a one-token forward (bandwidth-bound)
    drifted by more than an 8-token one (partly compute-bound): +40 % against +27 % in one run.
    No time of the run's own decoding is used.

    ``fns``: field role -> zero-argument forward. Every rank of a tensor-parallel group takes the
    same readings (the same forwards in the same order: the group's collectives stay matched),
    given the group's process ``group``: each forward then starts after a barrier. A TP forward
    lasts as long as its slowest rank; unaligned, a leader that ran behind its peer never waited
    for it and timed its own share only (16 ms against 22-33 ms aligned, bundled target at TP 2).
    The leader's readings are the run's."""

    def __init__(self, fns: ProbeFns, group: Any = None, requests: int = 1) -> None:
        self.fns, self.readings = fns, []
        self.every = max(1, -(-requests // MAX_READINGS))
        self.align = None
        if group is not None:
            import torch.distributed as dist

            self.align = lambda: dist.barrier(group=group)

    def take(self, index: int = 0) -> dict[str, float] | None:
        """A reading before request ``index`` (of every run pass: the same on every rank)."""
        if index % self.every:
            return None
        reading = time_functions(self.fns, repeats=RUN_REPEATS, warmup=1, align=self.align,
                                 cold=[role for role in self.fns if role.startswith("draft")])
        self.readings.append(reading)
        return reading

    def fields(self) -> dict[str, Any]:
        if not self.readings or not self.fns:
            return {}
        out: dict[str, Any] = {PROBE_FIELDS[role]: round(_trimmed_mean([r[role] for r in self.readings]), 7)
                               for role in self.fns}
        out["probe_points"] = len(self.readings)
        return out


def role_probes(target: Any, draft: Any, params: Any) -> ProbeFns:
    """The run's forwards for ``RunProbe``: the target (a real.model.decoder.Transformer, maybe a
    shard) at one, ``FORWARD_PROBE_SMALL_K`` and ``PROBE_TOKENS`` tokens, and the draft when it
    has a forward of its own (a real.model.drafts model, early-exit draft or eagle head; not the
    n-gram lookup) at one token, and a draft model's or an eagle head's tree expansion of
    ``PROBE_TOKENS`` rows. The KV slots written are overwritten by the first prefill."""
    fns: ProbeFns = {}
    if target is not None:
        fns.update(target_probes(target, params))
    model = getattr(draft, "model", None)
    if model is not None and model.max_seq < PROBE_CONTEXT + 2:
        model.setup_cache(PROBE_CONTEXT + 2)
    if draft is not None and getattr(draft, "forward_probs", None) is not None \
            and draft.forward_probs([1], PROBE_CONTEXT) is not None:
        fns["draft"] = lambda: draft.forward_probs([1], PROBE_CONTEXT)
    if model is not None:  # a draft model of its own: its tree expansions' size too
        fns["draft_k8"] = model_probe(model, params, tokens=PROBE_TOKENS, distributions=False)
    elif getattr(draft, "head", None) is not None:  # an eagle head: its tree expansions' size too
        fns["draft_k8"] = eagle_probe(draft, tokens=PROBE_TOKENS)
    if "draft" in fns:  # two steps back to back, after the draft's own forwards: warm steps
        step = fns["draft"]
        fns["draft_pair"] = lambda: (step(), step())
    return fns


def target_probes(target: Any, params: Any) -> ProbeFns:
    """The target's probe forwards: one token, the small verification sizes
    (``FORWARD_PROBE_SMALL_K``) and ``PROBE_TOKENS`` tokens, with their distributions."""
    fns: ProbeFns = {"target": model_probe(target, params)}
    for k in FORWARD_PROBE_SMALL_K:
        fns[f"target_k{k}"] = model_probe(target, params, tokens=k)
    fns["target_k8"] = model_probe(target, params, tokens=PROBE_TOKENS)
    return fns


def model_probe(model: Any, params: Any, tokens: int = 1, distributions: bool = True) -> Callable[[], Any]:
    """The probe forward of a whole model (or its shard): ``tokens`` tokens at ``PROBE_CONTEXT``
    and their distributions, as the profile's main table times k = ``tokens``
    (``TargetRunner.probs``); or every row's logits only (``distributions=False``), as its TP
    tables time a draft's tree expansion."""
    from real.model.runners import TargetRunner

    if model.max_seq < PROBE_CONTEXT + tokens + 1:
        model.setup_cache(PROBE_CONTEXT + tokens + 1)
    fed = [1] * tokens
    if not distributions:
        x = torch.tensor([fed], device=model.device)
        return lambda: model(x, input_pos=PROBE_CONTEXT)
    runner = TargetRunner(model, params)
    return lambda: runner.probs(fed, PROBE_CONTEXT)


def eagle_probe(draft: Any, tokens: int) -> Callable[[], Any]:
    """An eagle head's forward over ``tokens`` pairs at ``PROBE_CONTEXT`` with every row's logits
    (the target's LM head over all of them), as its tree expansions run and as the simulator
    costs them (sim/cost/profile_tables.EagleTreeForward): compute bound from a few rows, where
    its one-token probe is not; the features' values do not change its cost (zeros)."""
    head, target = draft.head, draft.target
    if head.body.max_seq < PROBE_CONTEXT + tokens + 1:
        head.body.setup_cache(PROBE_CONTEXT + tokens + 1)
    x = torch.ones(1, tokens, dtype=torch.long, device=target.device)
    feats = torch.zeros(1, tokens, target.args.dim, dtype=target.dtype, device=target.device)
    return lambda: head.logits(target, head(target, x, feats, PROBE_CONTEXT))


def _trimmed_mean(values: list[float]) -> float:
    """The mean without the lowest and highest of five or more readings: it follows a machine
    that shifts during the run, and one reading caught in a neighbour's burst does not move it
    (one such reading put a run's probe 10 % above its decode's level)."""
    v = sorted(values)
    return statistics.fmean(v[1:-1] if len(v) >= 5 else v)
