"""Contention between the two device groups of `schedule=async` on a CPU (`+calibrate`).

On a CPU node the draft group's core and the target group's core share the memory bus and the
last-level cache: a forward is slower while the other core streams the other model's weights.
``measure_contention`` measures it in one ``real.runtime.launch.launch`` of two pinned workers with one
intra-op thread each (how an async run executes):

- rank 0 times a tree-masked forward (real/calibrate/tp.py's ``tree`` shape; an eagle head's
  layer and the target's LM head over every node) of the *measured* model over k tokens at one
  context, first with rank 1 idle (``alone``), then while rank 1 runs
  forwards of the *busy* model back to back (``busy``: tree forwards of ``busy_k`` tokens, what a
  target verification or a draft expansion streams);
- for every (measured, busy) of the pair: (target, draft) and (draft, target); alone and busy
  samples interleave pass by pass, so drift of a shared machine hits both alike.

The profile keeps, per measured model, ``contended[busy model] = {"k", "context", "factor",
"alone_s", "busy_s"}`` with factor = busy / alone (medians) per k; sim/cost/profile.py multiplies
a forward by it where the two groups run concurrently (`async`).
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from testbed.config import ExperimentConfig, real_dtype

STOP, BUSY = 0, 1  # rank 0's commands to rank 1 (then: the busy model's index)


@dataclass
class ContentionGrid:
    k: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    context: int = 256
    busy_k: int = 8
    repeats: int = 7  # interleaved passes; the median is kept

    @classmethod
    def like(cls, tp_grid: Any) -> ContentionGrid:
        """The grid matching a ``real.calibrate.tp.TpGrid`` (a quick one stays quick)."""
        if tp_grid is None:
            return cls()
        ks = [k for k in tp_grid.k if k <= 16] or tp_grid.k[:1]
        return cls(k=ks, context=tp_grid.context[len(tp_grid.context) // 2],
                   busy_k=max(k for k in ks if k <= 8) if min(ks) <= 8 else ks[0], repeats=tp_grid.repeats)


def contention_worker(ctx: Any, models: dict[str, str | None], grid_d: dict[str, Any],
                      control: str) -> dict | None:
    """One rank (module level: spawned workers import it). ``models``: name -> weights path (None:
    the bundled GGUF), the first the target; ``control``: a path prefix for the stop flags (rank 1
    checks a file between forwards: cheaper and surer than polling a pending receive). Rank 0
    returns {(measured, busy): {"alone": {k: [s]}, "busy": {k: [s]}}}; rank 1 returns None."""
    from real.calibrate.tp import DTYPES

    grid = ContentionGrid(**grid_d)
    rank = ctx.info.index
    names = list(models)
    gen = torch.Generator().manual_seed(11)
    max_seq = grid.context + max(*grid.k, grid.busy_k) + 8
    with torch.inference_mode():
        loaded = _load_all(models, DTYPES[real_dtype(ctx.exp)], max_seq)
        if rank == 1:
            _neighbour(loaded, names, grid=grid, gen=gen, control=control)
            return None
        fns = {(n, k): _tree_fn(loaded[n], k=k, context=grid.context, gen=gen) for n in names for k in grid.k}
        for fn in fns.values():
            fn()  # warm-up
        pairs = [(m, b) for m in names for b in names if m != b]
        out: dict[tuple[str, str], dict[str, dict[int, list[float]]]] = {
            p: {"alone": {}, "busy": {}} for p in pairs}
        cmd = torch.zeros(2, dtype=torch.long)
        burst = 0
        for _ in range(grid.repeats):
            for measured, busy in pairs:
                _time_ks(fns, measured, grid.k, out[(measured, busy)]["alone"])
                cmd[0], cmd[1] = BUSY, names.index(busy)
                dist.send(cmd, 1)
                dist.recv(torch.zeros(1), 1)  # the neighbour is streaming
                _time_ks(fns, measured, grid.k, out[(measured, busy)]["busy"])
                Path(f"{control}.{burst}").touch()  # stop streaming
                burst += 1
        cmd[0] = STOP
        dist.send(cmd, 1)
    return out


def _load_all(models: dict[str, str | None], dtype: torch.dtype, max_seq: int) -> dict[str, Any]:
    """Each model by name; an eagle head's directory as (head, target): it reads the target's
    embedding and LM head (the target, first in ``models``, is loaded before it), with its
    folder's draft vocabulary if it has one (the bundled preset's setting: a run that sets
    ``pair.draft.draft_vocab=0`` is timed here with the folder's; these tables are ratios)."""
    from real.calibrate.tp import _load
    from real.model.eagle import is_eagle_dir, load_head
    from testbed.paths import repo_path

    out: dict[str, Any] = {}
    target = None
    for name, path in models.items():
        if path is not None and is_eagle_dir(repo_path(path)):
            assert target is not None, "the target comes first"
            head = load_head(repo_path(path), target)
            head.body.setup_cache(max_seq)
            out[name] = (head, target)
        else:
            out[name] = _load(path, dtype, max_seq)
            target = target if target is not None else out[name]
    return out


def _tree_fn(model: Any, *, k: int, context: int, gen: torch.Generator) -> Callable[[], Any]:
    """A tree-shaped forward over k nodes with every node's logits: a model's
    (real/calibrate/tp.py), or an eagle head's (its layer, then the target's LM head over every
    node, as its tree expansions run: real/model/eagle_tree.py)."""
    from real.calibrate.tp import _forward_fn, tree_mask

    if not isinstance(model, tuple):
        return _forward_fn(model, "tree", k=k, context=context, gen=gen)
    head, target = model
    x = torch.randint(target.args.vocab_size, (1, k), generator=gen)
    feats = torch.zeros(1, k, target.args.dim, dtype=target.dtype)  # its cost does not depend on them
    pos = torch.arange(context, context + k)
    mask, depths = tree_mask(k, context)

    def forward() -> Any:
        h = head.body.forward_layers(head.inputs(target, x, feats), pos, mask, position_ids=context + depths)
        return head.logits(target, h)
    return forward


def _time_ks(fns: dict, name: str, ks: list[int], into: dict[int, list[float]]) -> None:
    for k in ks:
        t = time.perf_counter()
        fns[(name, k)]()
        into.setdefault(k, []).append(time.perf_counter() - t)


def _neighbour(loaded: dict[str, Any], names: list[str], *, grid: ContentionGrid, gen: torch.Generator,
               control: str) -> None:
    """Rank 1: idle until told to stream a model's forwards, stream until the stop flag appears."""
    fns = {n: _tree_fn(loaded[n], k=grid.busy_k, context=grid.context, gen=gen) for n in names}
    cmd = torch.zeros(2, dtype=torch.long)
    burst = 0
    while True:
        dist.recv(cmd, 0)
        if int(cmd[0]) == STOP:
            return
        fn = fns[names[int(cmd[1])]]
        fn()
        dist.send(torch.zeros(1), 0)
        stop = Path(f"{control}.{burst}")
        while not stop.exists():
            fn()
        burst += 1


def contention_tables(raw: dict, grid: ContentionGrid) -> dict[str, dict[str, Any]]:
    """{measured: {busy: {"k", "context", "factor", "alone_s", "busy_s"}}} from the samples."""
    out: dict[str, dict[str, Any]] = {}
    for (measured, busy), s in raw.items():
        alone = [statistics.median(s["alone"][k]) for k in grid.k]
        contended = [statistics.median(s["busy"][k]) for k in grid.k]
        out.setdefault(measured, {})[busy] = {
            "k": grid.k, "context": grid.context, "busy_k": grid.busy_k,
            "factor": [round(b / a, 4) for a, b in zip(alone, contended)],
            "alone_s": alone, "busy_s": contended}
    return out


def measure_contention(exp: ExperimentConfig, models: dict[str, str | None],
                       grid: ContentionGrid | None = None,
                       log: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Launch two pinned workers and measure (module docstring); returns the tables per model."""
    from real.runtime.launch import launch

    grid = grid or ContentionGrid()
    e = copy.deepcopy(exp)
    e.backend = "real"
    e.real.recv_timeout_s = 900.0  # rank 1 waits while rank 0 measures alone
    e.schedule.name, e.schedule.tree = "sync", True  # two ranks, one per core
    e.placement.target_gpus = e.placement.draft_gpus = 2
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="contention") as tmp:
        results = launch(e, contention_worker, args=(models, asdict(grid), str(Path(tmp) / "stop")))
    raw = next(r.value for r in results if r.value is not None)
    tables = contention_tables(raw, grid)
    for measured, by in tables.items():
        for busy, t in by.items():
            log(f"contention: {measured} while {busy} runs on the other core: "
                + " ".join(f"k{k}=x{f:.2f}" for k, f in zip(t["k"], t["factor"])))
    log(f"contention: {time.perf_counter() - started:.1f} s")
    return tables


def add_contention(exp: ExperimentConfig, models: dict[str, Any], *, paths: dict[str, str | None],
                   log: Callable[[str], None], tp_grid: Any = None) -> None:
    """Measure the target against every draft model or eagle head of ``paths`` (target first)
    and store the tables in ``models[name]["contended"]``; a failure is logged and leaves the profile without
    them (the simulator then predicts async without contention)."""
    names = list(paths)
    target, grid = names[0], ContentionGrid.like(tp_grid)
    for draft in names[1:]:
        try:
            tables = measure_contention(exp, {target: paths[target], draft: paths[draft]}, grid, log)
        except Exception as e:  # noqa: BLE001 - the other tables are still useful
            log(f"contention {target}/{draft}: skipped ({type(e).__name__}: {e})")
            continue
        for measured, by in tables.items():
            models.setdefault(measured, {}).setdefault("contended", {}).update(by)
