"""Latency tables of batched forwards (continuous batching, real/runtime/batching.py) for the
profile cost model: per model, one round's forward over B requests x k tokens each at one context
(``BATCH_CONTEXT`` cached tokens per request), with what the round does per request after it
(the target: each request's distributions, as ``TargetRunner.probs``; a draft: the distribution
and pick of each request's next guess, as ``ChainWindow.take``).

They are timed in the same interleaved passes as the one-request tables (real/calibrate/profile.py),
so that the correction a run's probe forward makes to those tables (sim.profile_drift=run_probe)
applies to these alike: timed in passes of their own they came out ~20 % faster than the
one-request tables' regime, and the correction then under-predicted every batched round.

Why measured and not composed from the one-request tables: a batched forward is neither the
forward of its total tokens (each request attends over its own cache, and the per-request work
after it grows with B) nor B forwards (the weights are read once); on this host the additive
composition erred by +17 % on the target's verification of 8 requests and by -42 % on the
draft's steps. The simulator (sim/cost/profile.py ``batch_forward``) reads these tables,
interpolating in k and B, and adds each request's attention beyond ``BATCH_CONTEXT`` from the
one-request tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from real.calibrate.drafts import TEMPERATURES, picker
from real.calibrate.fit import isotonic

BATCH_CONTEXT = 128


def add_batch_probes(pr: Any, model: Any, *, name: str, role: str, batches: list[int],
                     ks: list[int]) -> Callable[[], dict[str, Any]]:
    """Register ``model``'s batched-forward probes on ``pr`` (a real.calibrate.profile.Probes);
    returns the function that builds its ``batch`` table afterwards."""
    from real.model.batch import CacheRows, Feed, forward_batch
    from testbed.spec.sampling import SamplingParams, standardize

    gen = torch.Generator().manual_seed(7)
    vocab = model.args.vocab_size
    # row 0 stays the model's batch-1 cache (the one-request probes' slots, up to the longest context)
    rows = CacheRows(model, max(batches), max(model.max_seq, BATCH_CONTEXT + max(ks) + 2))
    prompt = torch.randint(vocab, (BATCH_CONTEXT,), generator=gen).tolist()
    for r in range(1, max(batches) + 1):
        rows.prefill(r, prompt)

    def probe(b: int, k: int, params: SamplingParams) -> Callable[[], None]:
        feeds = [Feed(r, torch.randint(vocab, (k,), generator=gen).tolist(), BATCH_CONTEXT)
                 for r in range(1, b + 1)]
        if role == "target":
            def fn() -> None:
                for lg in forward_batch(model, feeds):
                    standardize(lg, params)
        else:
            pick = picker(params.greedy, gen)

            def fn() -> None:
                for lg in forward_batch(model, feeds):
                    pick(standardize(lg[-1], params))
        return fn
    return _register(pr, name, batches, ks, probe)


def add_eagle_batch_probes(pr: Any, draft: Any, *, name: str, batches: list[int],
                           ks: list[int]) -> Callable[[], dict[str, Any]]:
    """The same table for an eagle head (``draft``: an ``EagleDraft`` of its own, whose head's
    cache this takes over): one batched draft step of B requests as the batched server runs it
    (real/runtime/batching.py: ``eagle_rows_logits`` — the fc and the head's layer over every
    request's row, the target's LM head once over the batch — then each request's pick). The
    step's cost does not depend on the features' values, so zeros stand in for them."""
    from real.model.batch import CacheRows
    from real.model.eagle import RowEagleDraft, eagle_rows_logits
    from testbed.spec.sampling import SamplingParams, standardize

    gen = torch.Generator().manual_seed(7)
    head, target = draft.head, draft.target
    rows = CacheRows(head.body, max(batches), BATCH_CONTEXT + max(ks) + 2)
    zeros = torch.zeros(BATCH_CONTEXT + max(ks), target.args.dim, dtype=target.dtype, device=target.device)
    requests = []
    for r in range(1, max(batches) + 1):
        d = RowEagleDraft(head, target, draft.params, name, rows=rows, row=r)
        d.take_features(0, zeros)  # slots 1..BATCH_CONTEXT-1 of its row: attended, values immaterial
        requests.append(d)

    def probe(b: int, k: int, params: SamplingParams) -> Callable[[], None]:
        steps = [(d, torch.randint(target.args.vocab_size, (k,), generator=gen).tolist(), BATCH_CONTEXT)
                 for d in requests[:b]]

        pick = picker(params.greedy, gen)

        def fn() -> None:
            for lg in eagle_rows_logits(steps):
                pick(standardize(lg, params))
        return fn
    return _register(pr, name, batches, ks, probe)


def _register(pr: Any, name: str, batches: list[int], ks: list[int],
              probe: Callable[[int, int, Any], Callable[[], None]]) -> Callable[[], dict[str, Any]]:
    """One probe per (temperature class, B, k); the builder of the ``batch`` table."""
    from testbed.spec.sampling import SamplingParams

    for cls, temp in TEMPERATURES.items():
        for b in batches:
            for k in ks:
                pr.add((name, "batch", cls, b, k), probe(b, k, SamplingParams(temperature=temp)))

    def build() -> dict[str, Any]:
        out = {}
        for cls in TEMPERATURES:
            raw = [[pr.value((name, "batch", cls, b, k)) for k in ks] for b in batches]
            out[cls] = {"k": ks, "batch": batches, "context": BATCH_CONTEXT, "seconds": monotone_2d(raw),
                        "raw": raw}
        return out
    return build


def monotone_2d(raw: list[list[float]], rounds: int = 3) -> list[list[float]]:
    """raw[B][k] made non-decreasing in k (more tokens per request) and in B (more requests):
    pool adjacent violators along each axis in turn; a decrease along either is noise."""
    t = [list(row) for row in raw]
    for _ in range(rounds):
        t = [isotonic(row) for row in t]
        cols = [isotonic(list(col)) for col in zip(*t)]
        t = [list(row) for row in zip(*cols)]
    return t
