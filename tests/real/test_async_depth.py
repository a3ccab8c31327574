"""d of `schedule=async` round by round (testbed.spec.tree_drafter.AsyncDepth): the probe's d for
the first round, then async_depth of the rounds' own times — the controller alone, the real
draft worker driving it (scripted target, scripted clock) and the simulated one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from real.model.tree_tokens import LocalModel
from real.runtime.context import RealRequest
from real.runtime.links import Kind, Message
from real.schedules.async_tree import Side, draft_worker, unpack_batch
from testbed.metrics import tree_shape
from testbed.recorder import RunRecorder
from testbed.spec.sampling import SamplingParams
from testbed.spec.tree_drafter import MAX_ASYNC_DEPTH, AsyncDepth
from tests.conftest import compose_exp
from tests.helpers.real_models import tiny
from tests.sim.test_cost_profile_tp import profile_with_tp


def test_the_first_round_takes_the_probes_d_later_rounds_the_medians_of_their_own_times() -> None:
    ctl = AsyncDepth(tree_depth=0, t_target=0.065, t_draft=0.0009, reply_s=0.001)
    assert ctl.next_round() == MAX_ASYNC_DEPTH == ctl.first  # 65 / 0.9 -> the cap
    # one round: the target's span 59 ms (+ 1 ms reply), expansions of 1.4-1.6 ms
    assert ctl.observe(target_span=0.059, expansions=[0.0014, 0.0015, 0.0016]) == math.floor(60 / 1.5 + 0.5)
    assert ctl.next_round() == 40
    # medians over the windows: one slow round does not swing d
    ctl.observe(target_span=0.059, expansions=[0.0015] * 3)
    assert ctl.observe(target_span=0.200, expansions=[0.0100]) == 40
    # a round without a usable target time (the last of a request; no clock) keeps the expansions
    assert ctl.observe(target_span=None, expansions=[0.0030] * 9) == math.floor(60 / 3.0 + 0.5)
    assert ctl.observe(target_span=math.nan, expansions=[]) == 20
    assert ctl.summary_fields() == {"tree_depth_used": 64, "tree_depth_mean": 52.0,
                                    "tree_depth_min": 40, "tree_depth_max": 64}


def test_a_set_depth_never_changes() -> None:
    ctl = AsyncDepth(tree_depth=5, t_target=0.065, t_draft=0.001, reply_s=0.0)
    assert ctl.observe(target_span=0.5, expansions=[0.001] * 10) == 5 == ctl.next_round()
    assert AsyncDepth.constant(0).observe(target_span=0.1, expansions=[0.001]) == 0


class _Clock:
    """Run clock of the scripted draft: every reading advances it by ``tick`` seconds (the
    draft worker reads it twice within a timed expansion: 2 ticks)."""

    def __init__(self, tick: float) -> None:
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


class _Target:
    """A target that accepts nothing and answers each subtree ``span`` seconds after it was
    sent (its ``sent_s`` on the draft's clock), for ``rounds`` rounds."""

    def __init__(self, clock: _Clock, span: float, rounds: int) -> None:
        self.clock, self.span, self.rounds, self.sent_at = clock, span, rounds, 0.0
        self.depths: list[int] = []
        self.share = lambda v: v

    def send(self, msg: Message) -> None:
        self.sent_at, self.last = self.clock.t, msg

    def recv(self) -> Message:
        msg = self.last
        self.rounds -= 1
        batch, _, _ = unpack_batch(msg, "topk")
        kind = Kind.STOP if self.rounds <= 0 else Kind.VERIFIED
        bonus = (batch.tokens[1] + 1) % 7  # not the root's one child: the tree starts afresh
        return Message(kind, request_id=msg.request_id, round=msg.round, version=msg.version,
                       committed=msg.committed + 1, tensors=(torch.tensor([bonus]),),
                       sent_s=self.sent_at + self.span)


def test_the_real_draft_worker_grows_each_round_as_many_times_as_the_last_rounds_times_say() -> None:
    """Probe: d = 3. The target answers 30 ms after each subtree (+ 2 ms reply), and an
    expansion takes 1 ms on the draft's clock. Round 0's answer says nothing of the target's
    time (its subtree may have waited for the target's prefill): from the third round on, d = 32."""
    model = tiny(3)
    clock = _Clock(tick=0.0005)
    target = _Target(clock, span=0.030, rounds=4)
    side = Side(model, LocalModel(model), SamplingParams(), target, RunRecorder(), clock, 0)  # type: ignore[arg-type]
    ctl = AsyncDepth(tree_depth=0, t_target=0.003, t_draft=0.001, reply_s=0.002)
    with torch.inference_mode():
        draft_worker(side, RealRequest(0, "p", [3, 14, 15, 92], 64), ctl, width=1, budget=2)
    spans = side.rec.frames()[2]
    grown = spans[spans["kind"] == "expand"].groupby("round").size()
    # round r's subtree is sent, then round r+1's tree grows d times (plus the refill after the
    # re-root: one expansion, width 1, budget 2, one node kept)
    assert ctl.summary_fields() == {"tree_depth_used": 3, "tree_depth_mean": (3 + 3 + 32 + 32) / 4,
                                    "tree_depth_min": 3, "tree_depth_max": 32}
    assert list(grown.loc[1:4]) == [3 + 1, 3 + 1, 32 + 1, 32]
    assert list(grown.loc[0:0]) == [1]


def test_the_simulated_draft_adapts_d_to_the_modelled_expansions_as_the_real_one(tmp_path: Path) -> None:
    """An n-gram draft: the probe times a one-leaf expansion (1 ms), the rounds' expansions of
    up to four leaves cost up to 4 ms: after the first round d comes down."""
    from sim.runtime.engine import run

    prof = profile_with_tp()
    prof["models"]["ngram3"] = {**prof["models"].get("ngram3", {}), "tree_expand": {
        "greedy": {"leaves": [1, 4], "seconds": [0.001, 0.004]}}}
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(prof))
    common = ("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=profile", f"sim.profile_path={path}",
              "schedule=async", "schedule.tree_budget=8", "schedule.tree_width=4", "workload.num_prompts=2",
              "workload.max_new_tokens=32")
    x = run(compose_exp(*common)).extra
    first = min(MAX_ASYNC_DEPTH, math.floor(x["t_target_ms"] / 1.0 + 0.5))
    assert x["tree_depth_used"] == x["tree_depth_max"] == first
    assert x["tree_depth_min"] < first and x["tree_depth_mean"] < first
    assert x["tree_depth_min"] >= math.floor(x["t_target_ms"] / 4.0 * 0.5)  # not below a 4-leaf d
    fixed = run(compose_exp(*common, "schedule.tree_depth=6")).extra
    assert fixed["tree_depth_min"] == fixed["tree_depth_max"] == fixed["tree_depth_used"] == 6
    # what a run's summary line shows
    assert tree_shape(fixed) == "w=4 bs=8 d=6"
    assert tree_shape(x) == (f"w=4 bs=8 d={x['tree_depth_mean']:.3g} "
                             f"({x['tree_depth_min']}-{x['tree_depth_max']})")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
