"""backend=real schedule=decentralized (DSD) and `ar` over a pipeline of stage processes
(real/runtime/pipeline.py, real/runtime/pipeline_run.py, real/schedules/decentralized.py).

Multi-process runs use tiny random checkpoints (tests/helpers/tiny_checkpoint.py); the sampling test
drives the stage functions in this process (two threads joined by LoopbackTransports)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from real.errors import RealSetupError, WorkerFailed
from real.model.decoder import Transformer
from real.model.drafts import ModelDraft
from real.runtime.context import RealRequest
from real.runtime.links import Kind, Message
from real.runtime.pipeline import Stage, pack_dists, unpack_dists
from real.schedules.decentralized import (
    WindowVerifier,
    alpha_from_tokens,
    dsd_first_stage,
)
from testbed.links import draft_dists_bytes, dsd_window_bytes
from testbed.metrics import divergence
from testbed.recorder import RunRecorder
from testbed.spec.dsd import draft_params
from testbed.spec.sampling import SamplingParams, standardize
from testbed.theory import expected_tokens
from tests.conftest import compose_exp
from tests.helpers import pipeline_workers as pw
from tests.helpers.processes import assert_promised_files, live_workers
from tests.helpers.real_models import (
    TWO_TOKEN_PROMPT,
    exact_two_token_law,
    two_token_pair,
    two_token_tv,
)
from tests.helpers.ring import run_ring
from tests.helpers.tiny_checkpoint import write_tiny_checkpoint

LAYERS = 4


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_checkpoint(root / "target", seed=1, layers=LAYERS)
    draft = write_tiny_checkpoint(root / "draft", seed=2, layers=LAYERS, base=target, noise=0.02)
    return target, draft


def _exp(target: Path, draft: Path, *extra: str):  # type: ignore[no-untyped-def]
    return compose_exp("backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}",
                       f"pair.target.layers={LAYERS}", "workload.num_prompts=2",
                       "workload.max_new_tokens=12", "real.ignore_eos=true", "real.progress=false",
                       *extra)


@pytest.fixture(scope="module")
def single_process_ar(tiny_pair):  # type: ignore[no-untyped-def]
    from real.runtime.engine import run

    res = run(_exp(*tiny_pair, "schedule=ar", "real.threads=1"))
    return [r["output_ids"] for r in res.recorder.requests]


# ------------------------------------------------------- N processes, temperature 0
# 2 and 3 nodes slow: by default the two-stage ring is held to `ar` by
# test_decentralized_repeats_alternate_whole_runs_with_ar, and 4 nodes checks every assert here
@pytest.mark.parametrize("nodes", [pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow), 4])
def test_decentralized_equals_single_process_ar_at_temperature_0(tiny_pair, single_process_ar,  # type: ignore[no-untyped-def]
                                                                  nodes: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from real.runtime.engine import run

    exp = _exp(*tiny_pair, "schedule=decentralized", f"placement.nodes={nodes}", "schedule.gamma=3",
               "network=wan", "network.latency_ms=2", "network.jitter_ms=0.5")
    res = run(exp)
    assert_promised_files(tmp_path, exp, res)
    spec = [r["output_ids"] for r in res.recorder.requests]
    assert spec == single_process_ar
    assert [r["output_ids"] for r in res.baseline.requests] == single_process_ar  # ar on the pipeline
    x = res.extra
    assert x["processes"] == nodes and x["links_per_round_trip"] == nodes
    assert x["identical_share"] == 1.0 and x["first_divergence_mean"] == 12
    assert x["tokens_per_round"] > 1 and 0 < x["alpha_measured"] <= 1 and x["t1_ms"] > 0
    assert x["probe_target_s"] > 0 and x["probe_draft_s"] > 0  # the stages' probes summed; the draft's
    assert x["probe_target_k8_s"] > 0 and x["probe_draft_k8_s"] > 0  # and at 8 tokens (a draft model)
    rounds, _, timeline = res.recorder.frames()
    assert (rounds.verified_tokens == 4).all()
    kinds = set(zip(timeline.resource, timeline.kind))
    assert {("draft", "draft"), ("stage0", "verify"), (f"stage{nodes - 1}", "verify"),
            ("link stage0->stage1", "link"), (f"link stage{nodes - 1}->stage0", "link")} <= kinds
    assert not (timeline.kind == "decode").any()  # the baseline's spans are not the run's
    assert live_workers() == []


@pytest.mark.slow  # the runner-agnostic run_repeated: the default run has async's (test_real_async)
def test_decentralized_repeats_alternate_whole_runs_with_ar(tiny_pair, single_process_ar) -> None:  # type: ignore[no-untyped-def]
    """real.repeats=2 under DSD's pipeline (was silently ignored): two whole runs, each the
    schedule then ar over the pipeline, and intervals over both."""
    from real.runtime.engine import run

    res = run(_exp(*tiny_pair, "schedule=decentralized", "placement.nodes=2", "schedule.gamma=3",
                   "real.repeats=2"))
    x = res.extra
    assert x["repeats"] == 2 and x["measure_order"] == ["decentralized#0", "ar#0", "decentralized#1", "ar#1"]
    assert len(x["tokens_per_s_mean_ci95"]) == 2 and len(x["speedup_ci95"]) == 2
    assert [r["output_ids"] for r in res.recorder.requests] == single_process_ar
    assert live_workers() == []


@pytest.mark.slow
def test_ar_over_the_pipeline_is_the_baseline_schedule(tiny_pair, single_process_ar) -> None:  # type: ignore[no-untyped-def]
    from real.runtime.engine import run

    res = run(_exp(*tiny_pair, "schedule=ar", "placement.nodes=2"))
    assert [r["output_ids"] for r in res.recorder.requests] == single_process_ar
    assert res.extra["processes"] == 2 and res.baseline is None
    assert live_workers() == []


@pytest.mark.slow
def test_a_layer_count_other_than_the_preset_is_a_one_line_error(tiny_pair) -> None:  # type: ignore[no-untyped-def]
    from real.runtime.engine import run

    exp = _exp(*tiny_pair, "schedule=decentralized", "placement.nodes=2")
    exp.pair.target.layers = 30
    with pytest.raises(WorkerFailed, match=r"set pair.target.layers=4"):
        run(exp)
    assert live_workers() == []


def test_an_early_exit_draft_is_refused() -> None:
    from real.runtime.pipeline_run import check

    exp = compose_exp("backend=real", "pair=smollm2_135m+smollm2_exit10", "schedule=decentralized")
    with pytest.raises(RealSetupError, match="early exit"):
        check(exp)


# ------------------------------------------------------------------------------ faults
@pytest.mark.parametrize(("group", "load"), [("stage1", ()), pytest.param("stage0", (), marks=pytest.mark.slow),
                                             pytest.param("stage2", ("workload.concurrency=2",), marks=pytest.mark.slow)])
def test_a_killed_stage_ends_the_run_within_30_s(tiny_pair, group: str, load: tuple[str, ...],  # type: ignore[no-untyped-def]
                                                 tmp_path: Path) -> None:
    """Served one at a time or with requests in flight (the first stage then waits for answers
    on a thread of its own, real/runtime/pipelined.py): one line naming the stage, no worker left."""
    from real.runtime.launch import launch

    exp = _exp(*tiny_pair, "schedule=decentralized", "placement.nodes=3", "real.recv_timeout_s=20", *load)
    stamp = tmp_path / "killed"
    with pytest.raises(WorkerFailed) as e:
        launch(exp, pw.pipeline_rank_killed, args=(group, str(stamp)), timeout_s=240)
    rank = int(group[-1])
    assert str(e.value).startswith(f"rank {rank} (target, group {group}, layers ")
    assert str(e.value).endswith("died: killed by SIGKILL")
    assert time.time() - float(stamp.read_text()) < 30
    assert live_workers() == []


# ------------------------------------------------------------- draft distributions
def test_top_k_draft_distributions_travel_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    logits[2, :3] = 9.0  # a tie at the k-th logit keeps more than k tokens
    q = standardize(logits, draft_params(SamplingParams(temperature=0.7), topk=3))
    packed = pack_dists(q, 3)
    assert torch.equal(unpack_dists(packed, 300), q)
    assert packed[0].shape == (5, 3) or (q[2] > 0).sum() > 3
    assert torch.equal(unpack_dists(pack_dists(q, 0), 300), q)  # full rows


def test_both_backends_charge_the_window_s_payload() -> None:
    """The bytes testbed.links says a window costs (the simulator's charge) are the payload of
    the message real/runtime/pipeline.py sends."""
    hidden, vocab, gamma, k = 96, 49152, 4, 64
    logits = torch.randn(gamma, vocab)
    q = standardize(logits, draft_params(SamplingParams(temperature=1.0), topk=k))
    msg = Message(Kind.ACTIVATIONS, tensors=(torch.zeros(1, gamma + 1, hidden),
                                             torch.zeros(gamma + 1, dtype=torch.int32), *pack_dists(q, k)))
    dists = draft_dists_bytes(gamma, vocab=vocab, topk=k)
    assert msg.payload_bytes == dsd_window_bytes(gamma + 1, hidden=hidden, act_bytes=4, dists=dists)


# ------------------------------------------------------------------ DSD's adaptive rule
def _verify(p_row: list[float], q_row: list[float], guess: int, tau: float, seed: int) -> tuple[float, list[int]]:
    vocab = len(p_row)
    logits = torch.log(torch.tensor([p_row, p_row])).clamp_min(-1e4)  # γ = 1: rows for the guess, bonus
    v = WindowVerifier(SamplingParams(temperature=1.0), vocab, torch.Generator().manual_seed(seed),
                       adaptive=True, tau=tau)
    q = torch.tensor([q_row])
    msg = Message(Kind.ACTIVATIONS, tensors=(torch.empty(0), torch.tensor([0, guess], dtype=torch.int32),
                                             *pack_dists(q, 0)))
    from testbed.spec.dsd import dsd_verify

    p = standardize(logits, v.params)
    lambda1, lambda2, lambda3 = v.lambdas
    ratio = dsd_verify(p, q, torch.tensor([guess]), tau, lambda1=lambda1, lambda2=lambda2,
                       lambda3=lambda3).step.ratios[0]
    return ratio, v(logits, msg)


def test_tau_relaxes_only_non_key_tokens() -> None:
    """A non-key guess (close distributions) is accepted more often under τ > 0; a key guess
    (|P_t − P_d| > λ2) is verified against P_t whatever τ: same ratio, same outputs."""
    relaxed = ([0.2, 0.8, 0.0, 0.0], [0.3, 0.7, 0.0, 0.0], 0)
    key = ([0.1, 0.9, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0], 0)
    r0, _ = _verify(*relaxed, tau=0.0, seed=0)
    r5, _ = _verify(*relaxed, tau=0.5, seed=0)
    assert r0 == pytest.approx(0.2 / 0.3, rel=1e-5) and r5 > r0 + 0.1
    for seed in range(20):
        assert _verify(*key, tau=0.0, seed=seed) == _verify(*key, tau=0.5, seed=seed)
    changed = sum(_verify(*relaxed, tau=0.0, seed=s)[1] != _verify(*relaxed, tau=0.5, seed=s)[1]
                  for s in range(200))
    assert 0 < changed < 200  # only draws with u in (r0, r5] (and their resamples) differ


# ---------------------------------------------------- in process: temperature 1 sampling
def _ring_run(target: Transformer, draft: Transformer, exp, params: SamplingParams,  # type: ignore[no-untyped-def]
              requests: list[RealRequest]) -> RunRecorder:
    """Two stages in this process (stage1 on a thread), joined by LoopbackTransports."""
    rec = RunRecorder(keep_spans=False)
    copy = Transformer(target.args).init_random(11, std=0.8)
    copy.setup_cache()
    d = ModelDraft(draft, draft_params(params, exp.schedule.draft_topk), "d")

    def serve(s0: Stage) -> None:
        for req in requests:
            dsd_first_stage(s0, d, req, frozenset(), exp=exp, rec=rec, send_dists=True)

    run_ring(target, copy, split=target.args.n_layers // 2, rec=rec, serve=serve,
             make_verify=lambda m: WindowVerifier(params, target.args.vocab_size,
                                                  torch.Generator().manual_seed(1000 + m.request_id)))
    return rec


def test_decentralized_samples_the_target_distribution_at_temperature_1() -> None:
    """Two-token continuations of a fixed prompt through a two-stage ring with γ = 2 and a
    draft sampling its top-2 of 4 tokens (so q travels truncated): the empirical distribution
    matches the exact target distribution within a fixed TV tolerance."""
    target, draft = two_token_pair(2)
    params = SamplingParams(temperature=1.0)
    exp = compose_exp("schedule=decentralized", "schedule.gamma=2", "schedule.draft_topk=2")
    prompt = TWO_TOKEN_PROMPT
    p_exact = exact_two_token_law(target, params)
    n = 1200
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            rec = _ring_run(target, draft, exp, params, [RealRequest(i, "p", prompt, 2) for i in range(n)])
    finally:
        torch.set_num_threads(threads)
    tv = two_token_tv(rec.requests, p_exact)
    assert tv < 0.08, tv  # E[TV] of 1200 exact samples over 16 outcomes is ≈ 0.045
    rounds = rec.frames()[0]
    assert 0 < rounds.accepted.mean() < 2


# ------------------------------------------------------------------------ small helpers
def test_alpha_from_tokens_inverts_leviathan_eq_1() -> None:
    for alpha in (0.1, 0.5, 0.8, 0.95):
        assert alpha_from_tokens(expected_tokens(alpha, 8), 8) == pytest.approx(alpha, abs=1e-9)
    assert alpha_from_tokens(1.0, 8) == 0.0 and alpha_from_tokens(9.0, 8) == 1.0


def test_divergence_against_a_lossless_reference() -> None:
    d = divergence([[1, 2, 3], [1, 2, 3], [4, 5]], [[1, 2, 3], [1, 9, 3], [4, 5]])
    assert d == {"identical_share": pytest.approx(2 / 3), "first_divergence_mean": pytest.approx(6 / 3)}


# -------------------------------------------------------------------- the bundled pair
@pytest.mark.model
@pytest.mark.slow
def test_bundled_pair_decentralized_equals_ar_at_temperature_0() -> None:
    from real.runtime.engine import run

    res = run(compose_exp("backend=real", "schedule=decentralized", "placement.nodes=3", "network=wan",
                          "network.latency_ms=5", "workload.num_prompts=2", "workload.max_new_tokens=24",
                          "real.ignore_eos=true", "real.progress=false", "real.recv_timeout_s=120"))
    spec = [r["output_ids"] for r in res.recorder.requests]
    assert spec == [r["output_ids"] for r in res.baseline.requests]
    assert all(len(o) == 24 for o in spec) and res.extra["identical_share"] == 1.0
    assert live_workers() == []
