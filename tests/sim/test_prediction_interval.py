"""Prediction intervals of trace-replay predictions (sim/runtime/prediction_interval.py): a bootstrap
over the trace's prompts and rounds, around the point prediction, deterministic per seed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sim.oracle.trace import RequestTrace
from sim.runtime.engine import run as sim_run
from sim.runtime.prediction_interval import resample_traces
from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.results import write_run
from tests.conftest import compose_exp
from tests.sim.test_oracle_trace import N_TOKENS, sim_exp, write_trace_run


def test_resampling_draws_requests_then_their_own_rounds() -> None:
    traces = [RequestTrace([(4, 4)] * 5, 4), RequestTrace([(4, 0)] * 3 + [(4, 1)], 4)]
    for seed in range(20):
        out = resample_traces(traces, random.Random(seed))
        assert len(out) == 2
        for t in out:  # every resampled request is made of one recorded request's rounds
            assert set(t.rounds) <= {(4, 4)} or set(t.rounds) <= {(4, 0), (4, 1)}
            assert len(t.rounds) in (5, 4)


def test_resampled_rounds_keep_their_own_draft_features() -> None:
    """A confidence or DISCO prediction reads each round's per-token features: a resampled
    round carries the features recorded with it (they were dropped, and the interval failed)."""
    rounds = [(2, 2), (2, 0), (2, 1)]
    features = [[[float(r), float(i)] for i in range(d)] for r, (d, _) in enumerate(rounds)]
    out = resample_traces([RequestTrace(rounds, 2, features)], random.Random(3))
    for t in out:
        assert t.features is not None and len(t.features) == len(t.rounds)
        for rnd, feats in zip(t.rounds, t.features):
            assert rounds[int(feats[0][0])] == rnd  # the features of the very round drawn
    assert resample_traces([RequestTrace(rounds, 2)], random.Random(3))[0].features is None


def test_interval_surrounds_the_prediction_and_is_deterministic(tmp_path: Path) -> None:
    write_trace_run(tmp_path / "real", gamma=4, requests=4)
    exp = sim_exp(tmp_path / "real", 4, 4, "sim.prediction_resamples=40")
    a, b = (sim_run(exp).extra for _ in range(2))
    assert a["prediction_resamples"] == 40
    for m in ("tokens_per_s", "tpot_ms", "speedup", "mean_accepted_len"):
        lo, hi = a[f"{m}_pi95"]
        assert lo < hi, m  # prompts that accept differently: a real spread
        assert a[f"{m}_pi95"] == b[f"{m}_pi95"]
    plain = sim_run(sim_exp(tmp_path / "real", 4, 4)).extra
    assert "tokens_per_s_pi95" not in plain  # off by default


def test_a_trace_without_variation_gives_a_point_interval(tmp_path: Path) -> None:
    # every request accepts 2 of 4 in every round: nothing for the bootstrap to vary
    exp_real = compose_exp("backend=real", "pair=smollm2_135m+ngram3", "schedule.gamma=4",
                           "workload.split=calibrate", f"workload.max_new_tokens={N_TOKENS}",
                           "sampling.temperature=0.0")
    rec = RunRecorder()
    for rid in range(3):
        for i in range(N_TOKENS // 3):
            rec.round(request_id=rid, round_idx=i, start_s=0.01 * i, end_s=0.01 * (i + 1), drafted=4,
                      checked=3, accepted=2, emitted=3, verified_tokens=5, draft_s=0.001, target_s=0.009)
        rec.request(RequestRecord(request_id=rid, prompt_id=f"p{rid}", prompt_len=100, output_ids=[],
            generated=N_TOKENS, prefill_s=0.1, decode_s=0.2, rounds=N_TOKENS // 3))
    write_run(tmp_path / "flat", exp_real, RunResult(recorder=rec))
    x = sim_run(sim_exp(tmp_path / "flat", 4, 3, "sim.prediction_resamples=10")).extra
    lo, hi = x["mean_accepted_len_pi95"]
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
    lo, hi = x["tokens_per_s_pi95"]
    assert hi - lo == pytest.approx(0.0, abs=1e-9 * hi)


def test_resamples_on_every_core_give_the_sequential_interval_and_leave_no_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow prediction's resamples run in a process pool: the interval is the very one of the
    sequential loop (traces drawn up front, in the same order), and the pool is gone after."""
    import os

    import psutil

    import sim.runtime.prediction_interval as pi
    from testbed.app import worker_pool

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to run in parallel")
    write_trace_run(tmp_path / "real", gamma=4, requests=4)
    exp = sim_exp(tmp_path / "real", 4, 4, "sim.prediction_resamples=12")
    sequential = sim_run(exp).extra
    workers: list[int] = []
    real_workers = pi.parallel_workers
    monkeypatch.setattr(pi, "PARALLEL_FROM_S", 0.0)  # every prediction counts as slow
    monkeypatch.setattr(pi, "parallel_workers", lambda s: workers.append(real_workers(s)) or workers[-1])
    try:
        parallel = sim_run(exp).extra
    finally:
        worker_pool.shutdown()
    assert workers and workers[0] >= 2  # it did use a pool
    for m in pi.METRICS:
        assert parallel[f"{m}_pi95"] == sequential[f"{m}_pi95"], m
    # (the resource trackers joblib and multiprocessing start live as long as this process)
    workers_left = [c for c in psutil.Process().children(recursive=True)
                    if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline())]
    assert not workers_left
