"""The metric definitions (README "Outputs", docs/architecture.md) — one definition for both backends.

- tokens_per_s: generated tokens / decode wall time, per request, then the mean over requests
  (prefill excluded; reported separately as prefill_s, the mean per request).
- tpot_ms: decode ms per output token, per request, then the mean over requests.
- speedup: tokens_per_s / tokens_per_s of `ar` on the same hardware, models and workload.
- alpha: accepted drafted tokens / drafted tokens on the verified path (the accepted ones plus
  the first rejected one): the estimator of Leviathan's α = E[β].
- mean_accepted_len: tokens a verification yields (accepted + the bonus token), averaged over
  verifications, before the output-length cap truncates the last round; 1.0 for `ar`.
- compression_ratio: mean_accepted_len − 1 (SwiftSpec's accepted guesses per verification).
- draft_efficiency: mean_accepted_len / (γ + 1).
- tree_shape: for token trees "w=… bs=… d=…" (``tree_shape``), beside tokens per verification.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from testbed.config import ExperimentConfig
from testbed.schedules import schedule_impl, spec_of

KEY_FIELDS = ("backend", "schedule", "pair", "hardware", "target_gpus", "draft_gpus", "nodes",
              "gamma", "workload", "temperature", "seed", "lookahead")
# for token trees mean_accepted_len (tokens per verification) is the acceptance figure to read:
# alpha counts a tree's rejected siblings too, so a tree's alpha says little next to a chain's
HEADLINE = ("tokens_per_s", "tpot_ms", "speedup", "alpha", "mean_accepted_len", "tree_shape",
            "prefill_s", "pass_at_1", "pass_at_1_baseline")  # pass@1: workload.exec_tests=true


def tree_shape(summary: dict[str, Any]) -> str | None:
    """"w=8 bs=16 d=4" for a token-tree run (the width, budget and depth it used), else None;
    an `async` run whose d changed from round to round: "d=17.3 (15-61)" (mean, range)."""
    w, bs, d = (summary.get(k) for k in ("tree_width", "tree_budget", "tree_depth_used"))
    if w is None or bs is None:
        return None
    lo, hi, mean = (summary.get(f"tree_depth_{k}") for k in ("min", "max", "mean"))
    if lo is not None and hi is not None and mean is not None and lo != hi:
        return f"w={w} bs={bs} d={mean:.3g} ({lo}-{hi})"
    return f"w={w} bs={bs}" + (f" d={d}" if d is not None else "")


def experiment_key(exp: ExperimentConfig) -> dict[str, Any]:
    drafts = spec_of(exp).drafts  # a schedule without a draft (`ar`) has no draft GPUs, γ or policy
    return {
        "backend": exp.backend,
        "schedule": schedule_impl(exp),
        "pair": exp.pair.name,
        "hardware": exp.hardware.name,
        "target_gpus": exp.placement.target_gpus,
        "draft_gpus": exp.placement.draft_gpus if drafts else 0,
        "nodes": exp.placement.nodes,
        "gamma": exp.schedule.gamma if drafts else 0,
        "workload": exp.workload.name,
        "temperature": exp.sampling.temperature,
        "seed": exp.seed,
        "lookahead": exp.lookahead.policy if drafts else "static",
    }


def _clean(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def request_tokens_per_s(requests: pd.DataFrame) -> float:
    ok = requests[requests["decode_s"] > 0]
    return float((ok["generated"] / ok["decode_s"]).mean()) if len(ok) else float("nan")


def summarize(rounds: pd.DataFrame, requests: pd.DataFrame, gamma: int,
              baseline_requests: pd.DataFrame | None = None) -> dict[str, Any]:
    """Headline metrics from one run's rounds and requests (and its `ar` baseline's requests)."""
    tps = request_tokens_per_s(requests)
    ok = requests[requests["generated"] > 0]
    tpot = float((1e3 * ok["decode_s"] / ok["generated"]).mean()) if len(ok) else float("nan")
    drafted = int(rounds["drafted"].sum()) if len(rounds) else 0
    checked = int(rounds["checked"].sum()) if len(rounds) else 0
    accepted = int(rounds["accepted"].sum()) if len(rounds) else 0
    verifications = len(rounds)
    mal = float((rounds["accepted"] + 1).mean()) if verifications else float("nan")
    base_tps = request_tokens_per_s(baseline_requests) if baseline_requests is not None else float("nan")
    return {
        "tokens_per_s": _clean(tps),
        "tpot_ms": _clean(tpot),
        "speedup": _clean(tps / base_tps) if base_tps == base_tps and base_tps > 0 else None,
        "alpha": _clean(accepted / checked) if checked else None,
        "mean_accepted_len": _clean(mal),
        "prefill_s": _clean(float(requests["prefill_s"].mean())) if len(requests) else None,
        "ar_tokens_per_s": _clean(base_tps),
        "compression_ratio": _clean(mal - 1.0),
        "draft_efficiency": _clean(mal / (gamma + 1)) if drafted else None,
        "verifications": verifications,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "generated_tokens": int(requests["generated"].sum()) if len(requests) else 0,
        "decode_s_total": _clean(float(requests["decode_s"].sum())) if len(requests) else None,
        "num_requests": len(requests),
    }


def first_divergence(output: list[int], reference: list[int]) -> int:
    """The first position where ``output`` differs from ``reference``; an identical output
    counts its length (a prefix of the other counts the shorter length)."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return min(len(output), len(reference))


def divergence(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Quality of a lossy decoding (DSD with τ > 0) against a lossless reference of the same
    prompts: ``identical_share`` (outputs equal token for token) and ``first_divergence_mean``
    (mean over requests of ``first_divergence``)."""
    if not outputs or len(outputs) != len(reference):
        return {"identical_share": None, "first_divergence_mean": None}
    same = sum(o == r for o, r in zip(outputs, reference))
    firsts = [first_divergence(o, r) for o, r in zip(outputs, reference)]
    return {"identical_share": same / len(outputs), "first_divergence_mean": sum(firsts) / len(firsts)}


def _pcts(prefix: str, values: pd.Series) -> dict[str, float | None]:
    v = values.dropna()
    if v.empty:
        return {f"{prefix}_{k}": None for k in ("mean", "p50", "p90", "p99")}
    return {f"{prefix}_mean": _clean(float(v.mean())), f"{prefix}_p50": _clean(float(v.quantile(0.5))),
            f"{prefix}_p90": _clean(float(v.quantile(0.9))), f"{prefix}_p99": _clean(float(v.quantile(0.99)))}


def system_throughput(requests: pd.DataFrame) -> float:
    """Output tokens per second of the whole system: every token over the span from the first
    arrival to the last answer."""
    span = float(requests["finish_s"].max() - requests["arrival_s"].min()) if len(requests) else 0.0
    return float(requests["generated"].sum()) / span if span > 0 else float("nan")


def _tpot(q: pd.DataFrame) -> pd.Series:
    """ms per output token after the first, per request (NaN for a one-token answer)."""
    return 1e3 * (q["finish_s"] - q["first_token_s"]) / (q["generated"] - 1).where(q["generated"] > 1)


def mean_in_flight(requests: pd.DataFrame) -> float:
    """The time-weighted mean number of requests admitted and not yet answered, from the first
    admission to the last answer: a batched server's running batch with its prefills, and what a
    pipeline carries at once (whose stages each work on one request: ``mean_batch`` 1)."""
    admit, finish = requests["arrival_s"] + requests["queue_s"], requests["finish_s"]
    known = admit.notna() & finish.notna()  # (rows recorded without their load times: none)
    if not known.any():
        return float("nan")
    events = pd.concat([pd.Series(1, index=admit[known].values), pd.Series(-1, index=finish[known].values)])
    events = events.groupby(level=0).sum().sort_index()
    level = events.cumsum()
    times = events.index.to_numpy(dtype=float)
    span = times[-1] - times[0]
    return float((level.to_numpy()[:-1] * (times[1:] - times[:-1])).sum() / span) if span > 0 else float("nan")


def load_metrics(requests: pd.DataFrame, timeline: pd.DataFrame, *, slo_ttft_ms: float, slo_tpot_ms: float,
                 baseline_requests: pd.DataFrame | None = None) -> dict[str, Any]:
    """What serving under load is judged by (runs under testbed/arrivals.py's load): TTFT, TPOT
    (after the first token) and end-to-end latency per request (mean, P50, P90, P99), the
    queueing delay, the system's throughput and goodput (requests per second meeting both SLOs;
    a bound of 0 is no bound), the time-weighted mean batch of the target's forwards (a pipeline's:
    its stages') and of the requests in flight, and against
    `ar` at the same load the throughput (``load_speedup``) and the P50 TPOT (``tpot_speedup``)."""
    q = requests
    ttft = 1e3 * (q["first_token_s"] - q["arrival_s"])
    tpot = _tpot(q)
    e2e = 1e3 * (q["finish_s"] - q["arrival_s"])
    ok = pd.Series(True, index=q.index)
    if slo_ttft_ms > 0:
        ok &= ttft <= slo_ttft_ms
    if slo_tpot_ms > 0:
        ok &= tpot.fillna(0.0) <= slo_tpot_ms
    span = float(q["finish_s"].max() - q["arrival_s"].min()) if len(q) else 0.0
    # the target's forwards: its group's, or a pipeline's stages' (each stage is the target's layers)
    on_target = timeline["resource"].eq("target") | timeline["resource"].str.fullmatch(r"stage\d+") \
        if len(timeline) else None
    target = timeline[on_target & timeline["kind"].isin(["decode", "verify"])] if len(timeline) else timeline
    dur = (target["end_s"] - target["start_s"]) if len(target) else pd.Series(dtype=float)
    mean_batch = float((dur * target["batch"]).sum() / dur.sum()) if len(target) and dur.sum() > 0 else float("nan")
    tps = system_throughput(q)
    has_base = baseline_requests is not None and len(baseline_requests) > 0
    base = system_throughput(baseline_requests) if has_base else float("nan")
    base_tpot = float(_tpot(baseline_requests).median()) if has_base else float("nan")
    tpot_p50 = float(tpot.median()) if tpot.notna().any() else float("nan")
    return {
        "throughput_tok_s": _clean(tps),
        "ar_throughput_tok_s": _clean(base),
        "load_speedup": _clean(tps / base) if base == base and base > 0 else None,
        # open arrivals below saturation: the throughput is the offered load for every
        # schedule; what speculation changes is each token's latency
        "tpot_speedup": _clean(base_tpot / tpot_p50) if base_tpot == base_tpot and tpot_p50 > 0 else None,
        **_pcts("ttft_ms", ttft), **_pcts("tpot_ms", tpot), **_pcts("e2e_ms", e2e),
        "queue_ms_mean": _clean(float(1e3 * q["queue_s"].mean())) if len(q) else None,
        "queue_ms_p90": _clean(float(1e3 * q["queue_s"].quantile(0.9))) if len(q) else None,
        "goodput_req_s": _clean(float(ok.sum()) / span) if span > 0 else None,
        "slo_attainment": _clean(float(ok.mean())) if len(q) else None,
        "mean_batch": _clean(mean_batch),
        "mean_in_flight": _clean(mean_in_flight(q)),
    }
