"""real/calibrate/tree.py: a tree expansion's time beyond the draft's forward."""

from __future__ import annotations

import time

import torch

from real.calibrate.tree import GROWN, time_expansions
from testbed.spec.sampling import SamplingParams


class SlowForward:
    """A ForwardModel whose forward sleeps 20 ms and returns random logits over 512 tokens."""

    calls = 0

    def logits(self, tokens, *, input_pos, mask, position_ids):  # type: ignore[no-untyped-def]
        assert mask.shape[0] == len(tokens) and len(position_ids) == len(tokens)
        self.calls += 1
        time.sleep(0.02)
        return torch.randn(len(tokens), 512)

    def move_kv(self, src, dst) -> None:  # type: ignore[no-untyped-def]
        pass


def test_the_forward_is_subtracted_and_every_leaf_count_is_timed() -> None:
    model = SlowForward()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibration runs it (real.threads=1): no waits on a busy core
    try:
        for temp in (0.0, 1.0):
            out = time_expansions(model, 512, SamplingParams(temperature=temp), leaves=(1, 2, 4), passes=5)
            assert out["leaves"] == [1, 2, 4]
            # each expansion slept 20 ms in its forward: had it not been subtracted, every
            # value would exceed 20 ms; the selection over 512 tokens is far below that
            assert all(0.0 < s < 0.018 for s in out["seconds"]), out
            assert out["seconds"] == sorted(out["seconds"])  # isotonic in the number of leaves
    finally:
        torch.set_num_threads(threads)
    # every tree grown GROWN times (the tree an async draft keeps growing, not a fresh one)
    assert model.calls == 2 * max(1, 5 // 3) * 3 * GROWN


class CountingKv(SlowForward):
    """No sleep; records the KV moves a re-root asks for."""

    def __init__(self) -> None:
        self.moves: list[tuple[list[int], list[int]]] = []

    def logits(self, tokens, *, input_pos, mask, position_ids):  # type: ignore[no-untyped-def]
        return torch.randn(len(tokens), 512)

    def move_kv(self, src, dst) -> None:  # type: ignore[no-untyped-def]
        self.moves.append((list(src), list(dst)))
        time.sleep(0.004)  # the compaction's copy: must land in advance_s, not in select_s


def test_async_bookkeeping_times_select_and_a_reroot_that_keeps_a_subtree() -> None:
    from real.calibrate.tree import time_bookkeeping

    model = CountingKv()
    out = time_bookkeeping(model, 512, SamplingParams(temperature=0.0), leaves=(2, 4), passes=3)
    assert out["leaves"] == [2, 4]
    assert all(s > 0.004 for s in out["advance_s"]), out  # each re-root compacted the KV once
    assert all(0.0 < s < 0.004 for s in out["select_s"]), out
    assert len(model.moves) == 3 * 2
    # the re-root follows the tree's top path of two tokens: the second one's subtree (grown
    # GROWN times, so not empty) survives and is moved to the front of the tree's slots
    assert all(len(src) > 0 and len(src) == len(dst) for src, dst in model.moves)
