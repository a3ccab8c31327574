"""backend=real `async` under load (real/runtime/batching_async.py): the two groups serve a batch
of token trees; every request's answer equals the one it gets served alone (temperature 0:
`ar`'s; temperature 1: its one-request async draws), in one process over the loopback transport
and end to end over two processes."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from real.model.decoder import Transformer
from real.model.tree_tokens import LocalModel
from real.runtime.batching_async import draft_server, target_server
from real.runtime.context import RealRequest
from real.runtime.loopback import LoopbackTransport
from real.schedules.async_tree import Peer, Side, draft_worker, target_worker
from testbed.recorder import RunRecorder
from testbed.spec.sampling import SamplingParams
from testbed.spec.tree_drafter import AsyncDepth
from tests.conftest import compose_exp
from tests.helpers.processes import live_workers
from tests.helpers.real_models import TINY, tiny
from tests.helpers.two_sides import run_both

two_cores = pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2,
                               reason="needs two cores (one worker per core)")
WIDTH, BUDGET, DEPTH = 3, 5, 2


def _requests(n: int) -> list[RealRequest]:
    gen = torch.Generator().manual_seed(4)
    return [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (3 + 4 * (i % 3),), generator=gen).tolist(),
                        6 + 5 * (i % 3)) for i in range(n)]


def _sides(target: Transformer, draft: Transformer, params: SamplingParams) -> tuple[Side, Side, list]:
    ends = LoopbackTransport.connect("bridge", (0, 1), recv_timeout_s=60.0)
    rec = RunRecorder()

    def side(model: Transformer, me: int) -> Side:
        return Side(model, LocalModel(model), params, Peer(ends[me], ends[me], lambda m: m),
                    rec if me == 0 else RunRecorder(), time.perf_counter, 0)
    return side(target, 0), side(draft, 1), list(ends.values())


def _alone(target: Transformer, draft: Transformer, params: SamplingParams,
           reqs: list[RealRequest]) -> list[list[int]]:
    """Each request served by the one-request async workers, one after another."""
    target.setup_cache(256)
    draft.setup_cache(256)
    t, d, ends = _sides(target, draft, params)
    run_both(lambda: [target_worker(t, r, frozenset()) for r in reqs],
         lambda: [draft_worker(d, r, DEPTH, width=WIDTH, budget=BUDGET) for r in reqs], ends)
    return [r["output_ids"] for r in sorted(t.rec.requests, key=lambda r: r["request_id"])]


def _under_load(target: Transformer, draft: Transformer, params: SamplingParams, reqs: list[RealRequest],
                *load: str) -> RunRecorder:
    exp = compose_exp("schedule=async", f"schedule.tree_width={WIDTH}", f"schedule.tree_budget={BUDGET}",
                      f"sampling.temperature={params.temperature}", *load)
    t, d, ends = _sides(target, draft, params)
    got: list[list[int]] = []
    run_both(lambda: got.extend(target_server(t, exp, reqs, frozenset(), slots=64)),
         lambda: draft_server(d, exp, reqs, AsyncDepth.constant(DEPTH)), ends)
    assert got == [r["output_ids"] for r in sorted(t.rec.requests, key=lambda r: r["request_id"])]
    return t.rec


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("load", [("workload.concurrency=3",), ("workload.arrival=poisson", "workload.rate=300")])
def test_async_under_load_answers_each_request_as_served_alone(temperature: float, load: tuple[str, ...]) -> None:
    """Requests of different prompt and output lengths join and leave the batch of trees; each
    answer is the one the one-request async workers give it (temperature 0: greedy decoding)."""
    params = SamplingParams(temperature=temperature)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reqs = _requests(6)
        alone = _alone(tiny(0), tiny(1), params, reqs)
        rec = _under_load(tiny(0), tiny(1), params, reqs, *load)
    finally:
        torch.set_num_threads(threads)
    rounds, requests, timeline = rec.frames()
    assert [list(o) for o in requests.sort_values("request_id").output_ids] == alone
    assert [len(o) for o in alone] == [r.max_new_tokens for r in reqs]
    verify = timeline[(timeline.resource == "target") & (timeline.kind == "verify")]
    assert verify.batch.max() > 1  # the subtrees of several requests in one forward
    assert (rounds.verified_tokens <= BUDGET).all() and rounds.accepted.sum() > 0
    assert (requests.first_token_s >= requests.arrival_s + requests.queue_s).all()
    assert (requests.finish_s >= requests.first_token_s).all()


@pytest.mark.slow  # (~10 s; the in-process tests above hold every answer by default)
@two_cores
def test_async_under_load_on_two_processes_equals_ar_at_temperature_0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from real.runtime.engine import run
    from tests.helpers.tiny_checkpoint import write_tiny_checkpoint

    target = write_tiny_checkpoint(tmp_path / "target", seed=1, layers=3)
    draft = write_tiny_checkpoint(tmp_path / "draft", seed=2, layers=3, base=target, noise=0.3)
    exp = compose_exp("backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}",
                      "workload.num_prompts=4", "workload.max_new_tokens=16", "real.ignore_eos=true",
                      "real.progress=false", "schedule=async", f"schedule.tree_width={WIDTH}",
                      f"schedule.tree_budget={BUDGET}", "workload.concurrency=2")
    res = run(exp)
    key = "request_id"
    got = {r[key]: r["output_ids"] for r in res.recorder.requests}
    assert got == {r[key]: r["output_ids"] for r in res.baseline.requests}  # `ar` at the same load
    _, requests, timeline = res.recorder.frames()
    assert len(requests) == 4 and requests.arrival_s.notna().all()
    assert timeline[(timeline.resource == "target") & (timeline.kind == "verify")].batch.max() == 2
    assert {("link draft->target", "link"), ("link target->draft", "link")} <= set(zip(timeline.resource,
                                                                                        timeline.kind))
    assert live_workers() == []
