"""backend=real `decentralized` and `ar` over a pipeline under load (real/runtime/pipelined.py):
several requests in flight through the stages, each on its own KV-cache row on every stage.
Every request's answer equals its answer served alone (temperature 0: `ar`'s; temperature 1:
its own seeded draws), requests overlap in the ring, and admission keeps to the load's bound;
in this process over loopback links with a WAN delay, and end to end over stage processes."""

from __future__ import annotations

import pytest
import torch

from real.model.batch import CacheRows
from real.model.decoder import Transformer
from real.model.drafts import ModelDraft, NgramDraft, RowModelDraft
from real.model.eagle import EagleDraft, EagleHead, RowEagleDraft
from real.model.generate import greedy_generate
from real.runtime.context import RealRequest
from real.runtime.pipeline import Stage, ar_flow, run_alone
from real.runtime.pipelined import serve_pipelined
from real.schedules.decentralized import dsd_flow, make_verifier
from testbed.config import ConfigError
from testbed.recorder import RunRecorder
from testbed.spec.dsd import draft_params
from testbed.spec.sampling import SamplingParams
from tests.conftest import compose_exp
from tests.helpers.processes import live_workers
from tests.helpers.real_models import TINY, tiny
from tests.helpers.ring import run_ring

ROWS_SLOTS = 64
LATENCY_S = 0.004  # each way: a window's round trip waits on the links, so requests overlap


def _requests(n: int) -> list[RealRequest]:
    gen = torch.Generator().manual_seed(3)
    return [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (2 + 5 * (i % 3),), generator=gen).tolist(),
                        7 + 4 * (i % 3)) for i in range(n)]


def _draft_model() -> Transformer:
    """The target's weights, perturbed: it agrees often, not always."""
    model = tiny(1)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _ring(exp, params: SamplingParams, reqs: list[RealRequest], *, rows: int, draft: str | None,  # type: ignore[no-untyped-def]
          ) -> tuple[list[list[int]], RunRecorder]:
    """Two stages in this process (stage1 on a thread) joined by loopback links of LATENCY_S
    each way; ``rows`` 0: every request served alone, one after another; else under load."""
    rec = RunRecorder()
    half = TINY.n_layers // 2
    first, last = tiny(1), tiny(1)  # the same weights: stage0 runs the first half, stage1 the rest
    first.setup_cache(ROWS_SLOTS, max_batch=rows + 1, layers=(0, half))
    last.setup_cache(ROWS_SLOTS, max_batch=rows + 1, layers=(half, TINY.n_layers))
    dparams = draft_params(params, exp.schedule.draft_topk)
    model = _draft_model() if draft == "model" else None
    cache = CacheRows(model, rows, ROWS_SLOTS) if model is not None and rows else None
    if model is not None and not rows:
        model.setup_cache(ROWS_SLOTS)
    # an eagle head on the first stage (the target's embedding and LM head: stage0 holds every
    # weight), fed the target's features that stage1 returns; its own row per request under load
    head = EagleHead(TINY).init_random(2, std=0.5) if draft == "eagle" else None
    head_rows = CacheRows(head.body, rows, ROWS_SLOTS) if head is not None and rows else None

    def draft_of(row: int):  # type: ignore[no-untyped-def]
        if draft == "ngram":
            return NgramDraft(2, TINY.vocab_size)
        if head is not None:
            if head_rows is not None:
                return RowEagleDraft(head, first, dparams, "eagle", rows=head_rows, row=row)
            return EagleDraft(head, first, dparams, "eagle")
        if cache is not None:
            return RowModelDraft(model, dparams, "d", rows=cache, row=row)
        return ModelDraft(model, dparams, "d")

    def serve(s0: Stage) -> list[list[int]]:
        def flow(req: RealRequest, row: int):  # type: ignore[no-untyped-def]
            if draft is None:
                return ar_flow(s0, req, frozenset(), None, rec=rec, phase=0, row=row)
            return dsd_flow(s0, draft_of(row), req, frozenset(), exp=exp, rec=rec,
                            send_dists=not params.greedy and draft in ("model", "eagle"), row=row)

        if rows:
            return serve_pipelined(s0, exp, reqs, flow, rec=rec, rows=rows)
        return [run_alone(s0, flow(req, 0)) for req in reqs]

    try:
        outputs = run_ring(first, last, split=half, rec=rec, serve=serve, latency_s=LATENCY_S, features=head is not None,
                           make_verify=lambda m: make_verifier(exp, TINY.vocab_size, m.request_id, baseline=False))
    finally:
        first.keep_hidden = False
    return outputs, rec


def _in_flight(rec: RunRecorder) -> int:
    """The most requests admitted and not finished at one time."""
    _, requests, _ = rec.frames()
    admitted = requests.arrival_s + requests.queue_s
    return max(int(((admitted <= t) & (requests.finish_s > t)).sum()) for t in admitted)


def _rounds_overlap(rec: RunRecorder) -> bool:
    """Whether a round of one request ran while another request's round was in the ring."""
    rounds = rec.frames()[0]
    spans = list(zip(rounds.request_id, rounds.start_s, rounds.end_s))
    return any(a != b and s < e2 and s2 < e for a, s, e in spans for b, s2, e2 in spans)


@pytest.mark.parametrize(("schedule", "draft", "temperature"), [
    ("decentralized", "model", 0.0), ("decentralized", "model", 1.0), ("decentralized", "ngram", 0.0),
    ("decentralized", "eagle", 0.0), ("decentralized", "eagle", 1.0), ("ar", None, 1.0)])
def test_requests_in_flight_answer_as_served_alone(schedule: str, draft: str | None, temperature: float) -> None:
    exp = compose_exp(f"schedule={schedule}", "placement.nodes=2", "schedule.gamma=3",
                      f"sampling.temperature={temperature}", "workload.concurrency=3")
    params = SamplingParams(temperature)
    reqs = _requests(5)
    alone, _ = _ring(exp, params, reqs, rows=0, draft=draft)
    loaded, rec = _ring(exp, params, reqs, rows=3, draft=draft)
    assert loaded == alone
    assert [r["output_ids"] for r in sorted(rec.requests, key=lambda r: r["request_id"])] == alone
    if temperature == 0:  # lossless: the target's own greedy continuation
        target = tiny(1)
        assert alone == [greedy_generate(target, r.prompt_ids, r.max_new_tokens) for r in reqs]
    assert _in_flight(rec) == 3  # the closed loop's three clients, never more
    assert _rounds_overlap(rec)
    _, requests, _ = rec.frames()
    assert (requests.first_token_s > requests.arrival_s).all() and (requests.finish_s >= requests.first_token_s).all()


def test_poisson_arrivals_within_max_batch() -> None:
    exp = compose_exp("schedule=decentralized", "placement.nodes=2", "schedule.gamma=2",
                      "workload.arrival=poisson", "workload.rate=400", "workload.num_prompts=5",
                      "serving.max_batch=2")
    params = SamplingParams(0.0)
    reqs = _requests(5)
    alone, _ = _ring(exp, params, reqs, rows=0, draft="model")
    loaded, rec = _ring(exp, params, reqs, rows=2, draft="model")
    assert loaded == alone
    assert _in_flight(rec) <= 2
    _, requests, _ = rec.frames()
    assert (requests.queue_s > 0).any()  # five arrivals within ~12 ms wait for the two rows


def test_a_one_node_pipeline_under_load_is_refused_with_one_line() -> None:
    with pytest.raises(ConfigError, match=r"placement.nodes.*2 or more under load"):
        compose_exp("backend=real", "schedule=decentralized", "placement.nodes=1", "workload.concurrency=2")


def test_decentralized_under_load_over_stage_processes_equals_ar(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """End to end: two stage processes, three clients; the `ar` baseline at the same load over
    the same pipeline; both equal single-process `ar`."""
    from real.runtime.engine import run
    from tests.helpers.tiny_checkpoint import write_tiny_checkpoint

    target = write_tiny_checkpoint(tmp_path / "target", seed=1, layers=4)
    draft = write_tiny_checkpoint(tmp_path / "draft", seed=2, layers=4, base=target, noise=0.02)
    common = (f"pair.target.path={target}", f"pair.draft.path={draft}", "pair.target.layers=4",
              "workload.num_prompts=4", "workload.max_new_tokens=12", "real.ignore_eos=true",
              "real.progress=false", "backend=real")
    ar = run(compose_exp(*common, "schedule=ar", "real.threads=1"))
    expected = {r["request_id"]: r["output_ids"] for r in ar.recorder.requests}
    res = run(compose_exp(*common, "schedule=decentralized", "placement.nodes=2", "schedule.gamma=3",
                          "network=wan", "network.latency_ms=3", "workload.concurrency=3"))
    assert {r["request_id"]: r["output_ids"] for r in res.recorder.requests} == expected
    assert {r["request_id"]: r["output_ids"] for r in res.baseline.requests} == expected
    assert _in_flight(res.recorder) == 3 and _rounds_overlap(res.recorder)
    assert res.extra["processes"] == 2
    assert live_workers() == []
