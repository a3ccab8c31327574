"""Tree-expansion overhead beyond the draft's forward, for the latency profile (real/calibrate/profile.py).

An expansion of a token tree (testbed.spec.tree_drafter.TreeDrafter over real/model/tree_tokens.py's
DraftTreeTokens) does more than the draft's forward: it builds the expansion mask and positions,
turns the logits at its n leaves into distributions over the whole vocabulary (a softmax at
temperature 1 to rank at temperature 0, ``standardize`` otherwise), picks each leaf's w children
(top-k over the vocabulary, or sampling) and grows the DraftTree. On this CPU with a 49k
vocabulary that is ~1.4 ms per expansion of 8 leaves next to a 4.7 ms forward — a quarter of
the serial tree's draft phase, which the simulator did not charge (it predicted the draft
phase 34 % short).

Here whole expansions of the draft model are timed and the time of its forward subtracted, so
what remains is the overhead, by the number of leaves expanded. Stored per transformer draft (it depends on the vocabulary and the
temperature class, not on the model's layers) as

    "tree_expand": {cls: {"leaves": [...], "seconds": [...], "raw": [...]}}

and charged by the simulator per expansion (sim/oracle/tree_tokens.TimedTreeDrafter).

A tree's draft does two more things per round, both on the critical path (the target waits
for the subtree): it selects the subtree of bs nodes (`async` also packs it into a message),
and, once the verified tokens are back, re-roots the tree and compacts its KV slots.
In real runs of the bundled pair they took ~1.8 % of decode time (select 0.4 ms, re-root 0.6 ms
per ~65 ms round), which the simulator charged nothing. Timed on the same grown trees (width n,
budget 2n, the re-root to the top path of two tokens, whose subtree survives) as

    "tree_rounds": {cls: {"leaves": [...], "select_s": [...], "advance_s": [...]}}

The n-gram draft has no forward to subtract: its expansions are timed whole (lookups,
distributions over the target's vocabulary, the children's selection) by the leaves that occur,
with its own select and re-root, in the same two tables (``add_ngram_tree_tables``).

An eagle head's expansions are timed the same way (``add_eagle_tree_tables``), beyond its own
head forwards; the forward itself, which computes every node's logits, the simulator takes from
the head's batched table (sim/cost/profile_tables.EagleTreeForward).

    python -m real.calibrate.tree [PROFILE]     re-measures both tables of PROFILE's drafts in place
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from real.calibrate.fit import isotonic
from real.model.eagle_tree import EagleTreeTokens
from testbed.config import real_dtype
from testbed.spec.sampling import SamplingParams

LEAVES = (1, 2, 4, 8, 16)
PASSES = 15


class TimedForward:
    """A ForwardModel (real/model/tree_tokens.py) that passes calls on and accumulates the time spent
    in its forward, so that it can be subtracted from the expansion's."""

    def __init__(self, model: Any) -> None:
        self.model, self.spent = model, 0.0

    def logits(self, tokens: Sequence[int], *, input_pos: torch.Tensor, mask: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = self.model.logits(tokens, input_pos=input_pos, mask=mask, position_ids=position_ids)
        self.spent += time.perf_counter() - t
        return out

    def move_kv(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.model.move_kv(src, dst)


class TimedEagleTreeTokens(EagleTreeTokens):
    """An eagle head's tree source (real/model/eagle_tree.py) that adds the time of its head
    forwards to ``spent``, so that an expansion can be timed beyond its forward."""

    spent = 0.0

    @classmethod
    def started(cls, draft: Any, params: SamplingParams, history: list[int], *, cache_slots: int,
                generator: torch.Generator | None = None) -> TimedEagleTreeTokens:
        """A source over ``history`` whose features are placeholders (zeros)."""
        draft.start(history, features=torch.zeros(len(history) - 1, draft.target.args.dim,
                                                   dtype=draft.target.dtype, device=draft.target.device))
        return cls(draft, params, history, cache_slots=cache_slots, generator=generator)

    def _head_forward(self, tokens: list[int], feats: Tensor, input_pos: Tensor, mask: Tensor,
                      position_ids: Tensor, leaves: int) -> tuple[Tensor, Tensor]:
        t = time.perf_counter()
        out = super()._head_forward(tokens, feats, input_pos, mask, position_ids, leaves)
        self.spent += time.perf_counter() - t
        return out


def time_expansions(model: Any, vocab: int, params: SamplingParams, *, leaves: Sequence[int] = LEAVES,
                    passes: int = PASSES, history_len: int = 64, source: Any = None) -> dict[str, Any]:
    """Median seconds of one expansion of n leaves beyond the forward of ``model`` (a
    ForwardModel, e.g. real/model/tree_tokens.LocalModel of the draft), for each n of ``leaves``: a
    tree of width n is grown from its root until an expansion of n leaves (the one timed).
    ``source(history, generator)``: the draft source instead, which accumulates the time of its
    own forwards in ``spent`` (an eagle head's, ``TimedEagleTreeTokens``)."""
    from real.model.tree_tokens import DraftTreeTokens

    gen = torch.Generator().manual_seed(0)
    history = torch.randint(vocab, (history_len,), generator=gen).tolist()
    if source is None:
        timed = TimedForward(model)

        def source(h: list[int], g: torch.Generator) -> Any:
            return DraftTreeTokens(timed, params, h, g), timed
    else:
        make = source

        def source(h: list[int], g: torch.Generator) -> Any:
            src = make(h, g)
            return src, src
    raw: dict[int, list[float]] = {n: [] for n in leaves}
    gc.collect()  # (the collector runs inside the expansions timed, as it does in a run)
    _grow(source, history=history, gen=gen, leaves=leaves, passes=passes, raw=raw)
    med = [statistics.median(raw[n]) for n in leaves]
    return {"leaves": list(leaves), "seconds": isotonic(med), "raw": med}


GROWN = 12  # expansions per tree timed: the tree an async draft keeps growing, not a fresh one


def _grow(source: Any, *, history: list[int], gen: torch.Generator, leaves: Sequence[int], passes: int,
          raw: dict[int, list[float]]) -> None:
    """Per pass and width n, a tree grown ``GROWN`` times; every expansion of n leaves (all
    but the first, of the root alone) is a sample. The bookkeeping grows with the tree: on
    fresh two-expansion trees, with the collector off, the overhead read 0.76 ms for 8 leaves
    where an async draft's expansions measured 2.8 ms beyond their forward, and the simulator
    chose d = 10 where the real run chose 8-9."""
    from testbed.spec.tree_drafter import TreeDrafter

    with torch.inference_mode():
        for _ in range(max(1, passes // 3)):
            for n in leaves:
                src, timed = source(list(history), gen)  # (the source, what accumulates its forwards' time)
                drafter = TreeDrafter(src, width=n, budget=4 * n)
                for _ in range(GROWN):
                    timed.spent = 0.0
                    t = time.perf_counter()
                    step = drafter.expand()
                    took = time.perf_counter() - t - timed.spent
                    if step is None:
                        break
                    if len(step.leaves) == n:
                        raw[n].append(took)


def time_bookkeeping(model: Any, vocab: int, params: SamplingParams, *, leaves: Sequence[int] = LEAVES,
                     passes: int = PASSES, history_len: int = 64, source: Any = None) -> dict[str, Any]:
    """Median seconds of a tree's per-round draft bookkeeping on trees of width n (each n of
    ``leaves``, budget 2n) grown ``GROWN`` times: select + pack the subtree, and re-root + KV
    compaction on the two tokens of the tree's top path. ``source(history, generator)`` makes
    the draft source (default: ``model``'s DraftTreeTokens)."""
    from real.model.tree_tokens import DraftTreeTokens
    from real.runtime.async_messages import pack_batch
    from testbed.spec.tree_drafter import TreeDrafter

    gen = torch.Generator().manual_seed(1)
    history = ngram_history(vocab, history_len, gen) if source is not None else \
        torch.randint(vocab, (history_len,), generator=gen).tolist()
    if source is None:
        def source(h: list[int], g: torch.Generator) -> Any:
            return DraftTreeTokens(model, params, h, g)
    select: dict[int, list[float]] = {n: [] for n in leaves}
    advance: dict[int, list[float]] = {n: [] for n in leaves}
    gc.collect()
    with torch.inference_mode():
        for _ in range(passes):
            for n in leaves:
                drafter = TreeDrafter(source(list(history), gen), width=n, budget=2 * n)
                for _ in range(GROWN):
                    if drafter.expand() is None:
                        break
                t = time.perf_counter()
                pack_batch(drafter.select(), 0.0, 0.0)
                select[n].append(time.perf_counter() - t)
                tree = drafter.tree
                if not tree.children[0]:
                    continue  # (a lookup that found nothing: no tree to re-root)
                first = tree.children[0][0]  # topk: the most probable child, and its own
                second = tree.tokens[tree.children[first][0]] if tree.children[first] else 0
                verified = [tree.tokens[first], second]
                # a source that reads the target's features (an eagle head) gets placeholders:
                # the re-root's cost does not depend on their values
                features = drafter.source.placeholder_features(len(verified)) if drafter.source.reads_features else None
                t = time.perf_counter()
                drafter.advance(verified, features=features)
                advance[n].append(time.perf_counter() - t)
    return {"leaves": list(leaves),
            "select_s": isotonic([statistics.median(select[n]) for n in leaves]),
            "advance_s": isotonic([statistics.median(advance[n]) for n in leaves])}


NGRAM_HISTORY = 256  # tokens: a prompt and its generation so far, which every lookup scans


def ngram_history(vocab: int, n: int, gen: torch.Generator) -> list[int]:
    """A history whose n-grams recur, as text's do (random tokens over the whole vocabulary
    would never match, and a lookup that finds nothing costs less than one that does)."""
    phrases = torch.randint(vocab, (16, 8), generator=gen)
    picks = torch.randint(16, (-(-n // 8),), generator=gen)
    picks[-1] = picks[0]  # it ends in a phrase seen before: the root's lookup finds a next token
    return phrases[picks].flatten()[-n:].tolist()


def time_ngram_expansions(ngram: int, vocab: int, params: SamplingParams, *,
                          leaves: Sequence[int] = LEAVES, passes: int = PASSES) -> dict[str, Any]:
    """Median seconds of one whole expansion of n leaves of the n-gram draft's tree
    (testbed.spec.ngram.NgramTreeSource: a lookup per leaf, distributions over the target's
    vocabulary, the children's selection): it has no forward to subtract. An async n-gram draft
    expands 64 times a round; at temperature 1 an expansion of 4 leaves measured 0.6-0.9 ms in
    real runs where the simulator charged the chain's 0.05 ms lookup."""
    from testbed.spec.ngram import NgramTreeSource
    from testbed.spec.tree_drafter import TreeDrafter

    gen = torch.Generator().manual_seed(0)
    history = ngram_history(vocab, NGRAM_HISTORY, gen)
    mode = "topk" if params.greedy else "sample"
    raw: dict[int, list[float]] = {n: [] for n in leaves}
    gc.collect()
    with torch.inference_mode():
        for _ in range(max(1, passes // 3)):
            for n in leaves:
                source = NgramTreeSource(list(history), ngram=ngram, vocab=vocab, mode=mode, generator=gen)
                drafter = TreeDrafter(source, width=n, budget=4 * n)
                for _ in range(GROWN):
                    t = time.perf_counter()
                    step = drafter.expand()
                    took = time.perf_counter() - t
                    if step is None:
                        break
                    if len(step.leaves) == n:
                        raw[n].append(took)
    # an n-gram tree holds only the continuations the history has: wide expansions may not occur
    seen = [n for n in leaves if raw[n]]
    med = [statistics.median(raw[n]) for n in seen]
    return {"leaves": seen, "seconds": isotonic(med), "raw": med}


def add_ngram_tree_tables(models: dict[str, Any], drafts: list[Any], vocab: int, log: Any = print) -> None:
    """"tree_expand" and "tree_rounds" for every n-gram draft of ``drafts`` (the target's
    ``vocab``): whole expansions, and the per-round select and re-root."""
    from real.calibrate.drafts import TEMPERATURES
    from testbed.spec.ngram import NgramTreeSource

    for d in drafts:
        if d.kind != "ngram" or d.name not in models:
            continue
        params = {cls: SamplingParams(temperature=temp) for cls, temp in TEMPERATURES.items()}
        models[d.name]["tree_expand"] = {cls: time_ngram_expansions(d.ngram, vocab, p) for cls, p in params.items()}

        def source(p: SamplingParams, n: int = d.ngram) -> Any:
            return lambda h, g: NgramTreeSource(h, ngram=n, vocab=vocab,
                                                mode="topk" if p.greedy else "sample", generator=g)

        models[d.name]["tree_rounds"] = {cls: time_bookkeeping(None, vocab, p, source=source(p),
                                                               history_len=NGRAM_HISTORY)
                                         for cls, p in params.items()}
        cells = "; ".join(f"{cls}: " + " ".join(f"{n}={1e3 * s:.2f}" for n, s in zip(t["leaves"], t["seconds"]))
                          for cls, t in models[d.name]["tree_expand"].items())
        log(f"{d.name} tree expansion (whole: no forward), by leaves (ms): {cells}")


def add_tree_tables(models: dict[str, Any], drafts: list[Any], dtype: torch.dtype, log: Any = print) -> None:
    """Add "tree_expand" to the entry in ``models`` of every draft of ``drafts`` (ModelConfig)
    that can draw a tree (a transformer with its own weights), timed around its own forward."""
    from real.calibrate.drafts import TEMPERATURES
    from real.model.tree_tokens import LocalModel
    from real.model.weights import load_model
    from testbed.paths import repo_path

    for d in drafts:
        name = d.name
        if d.kind != "transformer" or not d.path or name not in models:
            continue
        try:
            model, _ = load_model(repo_path(d.path), dtype=dtype, max_seq=64)
        except Exception as e:  # noqa: BLE001 - the other tables are still useful
            log(f"{name} tree expansion: skipped ({type(e).__name__}: {e})")
            continue
        need = LEAVES[-1] * (GROWN + 1) + 64 + 2  # history + the tree's slots
        if model.max_seq < need:
            model.setup_cache(need)
        vocab = model.args.vocab_size
        # the serial tree keeps a replayed forward's logits on the GPU at temperature 0 (sync_tree)
        local = {cls: LocalModel(model, device_logits=temp == 0.0) for cls, temp in TEMPERATURES.items()}
        tables = {cls: time_expansions(local[cls], vocab, SamplingParams(temperature=temp))
                  for cls, temp in TEMPERATURES.items()}
        models[name]["tree_expand"] = tables
        models[name]["tree_rounds"] = {cls: time_bookkeeping(local[cls], vocab, SamplingParams(temperature=temp))
                                      for cls, temp in TEMPERATURES.items()}
        cells = "; ".join(f"{cls}: " + " ".join(f"{n}={1e3 * s:.2f}" for n, s in zip(t["leaves"], t["seconds"]))
                          for cls, t in tables.items())
        log(f"{name} tree expansion beyond the forward, by leaves (ms): {cells}")
        cells = "; ".join(f"{cls}: " + " ".join(f"{n}={1e3 * a:.2f}+{1e3 * b:.2f}" for n, a, b in
                                                zip(t["leaves"], t["select_s"], t["advance_s"]))
                          for cls, t in models[name]["tree_rounds"].items())
        log(f"{name} tree select + re-root per round, by leaves (ms): {cells}")


def add_eagle_tree_tables(models: dict[str, Any], drafts: list[Any], make: Any, log: Any = print) -> None:
    """"tree_expand" and "tree_rounds" for every eagle head of ``drafts`` (``make(config)``: its
    ``EagleDraft`` beside the target), its own head forwards subtracted as a draft model's are.
    The head's tree-shaped forward itself (every node's logits) the simulator reads from the
    head's batched table (sim/cost/profile_tables.EagleTreeForward)."""
    from real.calibrate.drafts import TEMPERATURES

    for d in drafts:
        if d.kind != "eagle" or d.name not in models:
            continue
        try:
            draft = make(d)
        except Exception as e:  # noqa: BLE001 - the other tables are still useful
            log(f"{d.name} tree expansion: skipped ({type(e).__name__}: {e})")
            continue
        vocab, slots = draft.target.args.vocab_size, LEAVES[-1] * (GROWN + 1) + 64 + 2

        def source(p: SamplingParams, draft: Any = draft, slots: int = slots) -> Any:
            return lambda h, g: TimedEagleTreeTokens.started(draft, p, h, cache_slots=slots, generator=g)

        params = {cls: SamplingParams(temperature=temp) for cls, temp in TEMPERATURES.items()}
        models[d.name]["tree_expand"] = {cls: time_expansions(None, vocab, p, source=source(p)) for cls, p in params.items()}
        models[d.name]["tree_rounds"] = {cls: time_bookkeeping(None, vocab, p, source=source(p), history_len=64)
                                         for cls, p in params.items()}
        cells = "; ".join(f"{cls}: " + " ".join(f"{n}={1e3 * s:.2f}" for n, s in zip(t["leaves"], t["seconds"]))
                          for cls, t in models[d.name]["tree_expand"].items())
        log(f"{d.name} tree expansion beyond the head's forward, by leaves (ms): {cells}")


def main(argv: Sequence[str] | None = None) -> None:
    """Re-measure the tree tables of a profile's drafts (draft models, eagle heads, n-gram
    lookups), in place (atomically)."""
    import argparse
    import json
    import os
    import tempfile
    from pathlib import Path

    from real.calibrate.drafts import drafts_to_measure
    from real.runtime.loading import DTYPES as dtypes
    from testbed.compose import compose_experiment
    from testbed.paths import CONF_DIR

    ap = argparse.ArgumentParser(prog="python -m real.calibrate.tree", description=main.__doc__)
    ap.add_argument("profile", nargs="?", default="reports/profiles/local.json")
    args = ap.parse_args(argv)
    path = Path(args.profile)
    try:
        prof = json.loads(path.read_text())
        models = prof["models"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: {path}: not a latency profile ({type(e).__name__}: {e}); measure one with "
                         "`python -m real.calibrate.profile`") from None
    target = next((name for name, m in models.items() if m.get("role") == "target"), "smollm2_135m")
    pair = next((f.stem for f in sorted((CONF_DIR / "pair").glob(f"{target}+*.yaml"))), None)
    if pair is None:
        raise SystemExit(f"error: no pair in conf/pair/ has the profile's target {target}")
    exp = compose_experiment([f"pair={pair}", f"real.dtype={prof.get('dtype', 'fp32')}"])
    torch.set_num_threads(int(prof.get("threads") or 1))
    add_tree_tables(models, drafts_to_measure(exp), dtypes[real_dtype(exp)])
    add_ngram_tree_tables(models, drafts_to_measure(exp), _target_vocab(exp))
    if any(d.kind == "eagle" for d in drafts_to_measure(exp)):
        add_eagle_tree_tables(models, drafts_to_measure(exp), _eagle_maker(exp))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(prof, f, indent=1)
    os.replace(tmp, path)
    print(f"updated {path}")


def _eagle_maker(exp: Any) -> Any:
    """``make(config)`` of add_eagle_tree_tables: an eagle head beside the profile's target."""
    from real.calibrate.drafts import make_draft
    from real.model.weights import load_model
    from real.runtime.loading import DTYPES as dtypes
    from testbed.paths import repo_path

    t = exp.pair.target
    target, tokenizer = load_model(None if t.path is None else repo_path(t.path), dtype=dtypes[real_dtype(exp)], max_seq=64)
    return lambda d: make_draft(exp, d, target, tokenizer, params=SamplingParams())


def _target_vocab(exp: Any) -> int:
    """The target's vocabulary size (the n-gram draft's distributions span it)."""
    from real.model.weights import load_model
    from testbed.paths import repo_path

    t = exp.pair.target
    model, _ = load_model(None if t.path is None else repo_path(t.path), dtype=torch.float32, max_seq=8)
    return int(model.args.vocab_size)


if __name__ == "__main__":
    main()
