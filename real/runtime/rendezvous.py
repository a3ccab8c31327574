"""Batched forwards for per-request code that calls a model itself (token trees under load).

The serial tree's drafter and verifier (testbed.spec.tree_drafter, real.model.tree_tokens) call
``model.logits(...)`` whenever they need distributions, in an order that depends on each tree.
Rather than rewrite them as step machines, a batched round runs each request's part in a thread
of its own, with a ``RowModel`` (the request's KV-cache row) as its model: a forward blocks until
every request still working has asked for one (or finished), and then all of them run as one
batched forward (real/model/batch.py) in the calling thread. The batches are therefore the same
whatever the threads' timing: lockstep by construction, each request's results as served alone.
KV moves touch only the request's own row and run in its thread. A part names the batched
function it joins (``call``): the parts of one kind of forward (a model's rows, with or without
their features; an eagle head's tree expansions, ``real.model.eagle.eagle_rows_tree``) run as
one call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from real.model.batch import CacheRows, Feed, forward_batch, forward_batch_features

BatchFn = Callable[[list[Any]], Sequence[Any]]  # the parts of several requests -> one result each
RECV_TIMEOUT_S = 600.0  # a request thread that never answers is a bug: fail, do not hang


class Rendezvous:
    """Runs one function per request in its own thread; their forwards meet in batched ones."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: dict[int, tuple[Any, BatchFn, Any]] = {}
        self.results: dict[int, torch.Tensor] = {}
        self.alive = 0

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """Each function's result, in order; the first exception of any is raised here."""
        outs: list[Any] = [None] * len(fns)
        errors: list[BaseException] = []

        def body(i: int, fn: Callable[[], Any]) -> None:
            try:
                with torch.inference_mode():
                    outs[i] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                errors.append(e)
            finally:
                with self.cond:
                    self.alive -= 1
                    self.cond.notify_all()

        self.alive = len(fns)
        threads = [threading.Thread(target=body, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
        for t in threads:
            t.start()
        with self.cond:
            while True:
                if not self.cond.wait_for(lambda: len(self.pending) >= self.alive, timeout=RECV_TIMEOUT_S):
                    raise RuntimeError(f"batched round: {self.alive - len(self.pending)} request(s) neither "
                                       f"asked for a forward nor finished within {RECV_TIMEOUT_S:.0f} s")
                if self.alive == 0:
                    break
                self._forward()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return outs

    def _forward(self) -> None:
        """Every pending part, one batched call per kind of forward, parts in request order."""
        by_key: dict[Any, tuple[BatchFn, list[int]]] = {}
        for i in sorted(self.pending):
            key, fn, _ = self.pending[i]
            by_key.setdefault(key, (fn, []))[1].append(i)
        for fn, idx in by_key.values():
            for i, out in zip(idx, fn([self.pending[i][2] for i in idx])):
                self.results[i] = out
        self.pending.clear()
        self.cond.notify_all()

    def call(self, index: int, key: Any, fn: BatchFn, item: Any) -> Any:
        """From request thread ``index``: its ``item`` in the next batched call of ``fn`` (the
        parts of all threads with the same ``key`` go to one call, which returns one result
        per part, in order); this part's result."""
        with self.cond:
            self.pending[index] = (key, fn, item)
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: index in self.results, timeout=RECV_TIMEOUT_S):
                raise RuntimeError(f"batched round: no forward within {RECV_TIMEOUT_S:.0f} s")
            return self.results.pop(index)


class RowModel:
    """One request's row of a batched model as a ``real.model.tree_tokens.ForwardModel``;
    ``features``: also keep the hidden states of its last forward (``last_hidden [T, dim]``, the
    last layer's output before the final norm: what an eagle head reads)."""

    def __init__(self, rows: CacheRows, row: int, meet: Rendezvous, index: Callable[[], int], *,
                 features: bool = False) -> None:
        self.rows, self.row, self.meet, self.index = rows, row, meet, index
        self.features = features
        self.last_hidden: torch.Tensor | None = None

    def logits(self, tokens: Sequence[int], *, input_pos: torch.Tensor, mask: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor:
        feed = Feed(self.row, list(tokens), mask=mask, slots=[int(s) for s in input_pos],
                    positions=[int(p) for p in position_ids])
        model = self.rows.model
        if not self.features:
            return self.meet.call(self.index(), (id(model), False), lambda feeds: forward_batch(model, feeds), feed)
        logits, self.last_hidden = self.meet.call(
            self.index(), (id(model), True), lambda feeds: list(zip(*forward_batch_features(model, feeds))), feed)
        return logits

    def move_kv(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.rows.move(self.row, list(src), list(dst))
