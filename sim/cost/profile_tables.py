"""The measured tables of a latency profile (reports/profiles/<hardware>.json, written by
real/calibrate/profile.py) and how the simulator reads them: loading with the schema check, piecewise-
linear interpolation on the measured grid (exact on grid points, linear beyond it), the TP/shape
ratio tables, the sampling-mode extra. `sim/cost/profile.py` builds the cost model on them."""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

from testbed.config import ConfigError

SCHEMA = 2
SCHEMAS = (1, 2)  # 1: no TP tables (TP 1 only)
SHAPES = ("chain", "tree")
CALIBRATE_CMD = "python -m testbed backend=real +calibrate"


def temperature_class(temperature: float) -> str:
    """Greedy decoding takes an argmax; any temperature > 0 a softmax and a draw over V."""
    return "greedy" if temperature == 0.0 else "sample"


def interp1(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear y(x) through (xs, ys) (xs increasing), linear beyond the ends."""
    if len(xs) == 1:
        return float(ys[0])
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    w = (x - x0) / (x1 - x0)
    return float(ys[i] + w * (ys[i + 1] - ys[i]))


class Table2D:
    """seconds[context index][k index] on the grid (k, context)."""

    def __init__(self, node: dict[str, Any]) -> None:
        self.k = [float(v) for v in node["k"]]
        self.context = [float(v) for v in node["context"]]
        self.seconds = [[float(v) for v in row] for row in node["seconds"]]
        if len(self.seconds) != len(self.context) or any(len(r) != len(self.k) for r in self.seconds):
            raise ValueError("profile table: seconds must be [len(context)][len(k)]")
        self._cache: dict[tuple[int, int], float] = {}

    def __call__(self, k: int, context: int) -> float:
        key = (k, context)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        rows = [interp1(k, self.k, row) for row in self.seconds]
        v = max(0.0, interp1(context, self.context, rows))
        if len(self._cache) < 1 << 16:
            self._cache[key] = v
        return v


class Table1D:
    def __init__(self, node: dict[str, Any], x: str) -> None:
        self.x = [float(v) for v in node[x]]
        self.seconds = [float(v) for v in node["seconds"]]

    def __call__(self, x: float) -> float:
        return max(0.0, interp1(x, self.x, self.seconds))


def load_profile(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError("sim.profile_path", str(path),
                          f"an existing latency profile: none found; measure one with `{CALIBRATE_CMD}`")
    try:
        prof = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("sim.profile_path", str(path), f"a readable JSON profile ({e}); "
                          f"measure it again with `{CALIBRATE_CMD}`") from None
    if not isinstance(prof, dict) or prof.get("schema") not in SCHEMAS:
        prof = prof if isinstance(prof, dict) else {}
        raise ConfigError("sim.profile_path", str(path), f"a profile of schema {SCHEMA} (found "
                          f"{prof.get('schema')!r}); measure it again with `{CALIBRATE_CMD}`")
    return prof


class ShapeFactor:
    """tp[n][shape] / tp[1][chain] of one model at (k, context) clamped to the TP grid."""

    def __init__(self, tables: dict[str, Any], degree: int) -> None:
        self.base = Table2D(tables["1"]["chain"])
        at = tables[str(degree)]
        self.shapes = {shape: Table2D(at[shape]) for shape in SHAPES if shape in at}
        self.k_range = (self.base.k[0], self.base.k[-1])
        self.c_range = (self.base.context[0], self.base.context[-1])

    def __call__(self, shape: str, k: int, context: int) -> float:
        table = self.shapes.get(shape) or self.shapes["chain"]
        kc = min(max(k, self.k_range[0]), self.k_range[1])
        cc = min(max(context, self.c_range[0]), self.c_range[1])
        base = self.base(kc, cc)
        return table(kc, cc) / base if base > 0 else 1.0


class TreeDraftForward:
    """A transformer draft's tree-shaped forward over k nodes at the group's TP degree n:
    ``forward[1, c] · tp[n][tree](k, c) / tp[1][chain](1, c)``.

    The main table times the drafter's chain step, whose LM head projects the last fed token only
    (a chain draft needs one distribution); an expansion of a token tree needs the logits of every
    node it feeds. Over a 49k vocabulary that head dominates a small draft: here the native
    head at 8 rows costs 2.3x one row (it turns compute-bound past 3 rows), so an expansion of 8
    leaves cost 1.6x what the main table said and the serial tree's draft phase was predicted 37 %
    short. The TP tables time forwards with every row's logits; their shape in k is used from one
    token, where one row is every row, on, at the main table's level there."""

    def __init__(self, main: Table2D, tables: dict[str, Any], degree: int) -> None:
        self.main = main
        self.base = Table2D(tables["1"]["chain"])
        at = tables[str(degree)]
        self.tree = Table2D(at.get("tree") or at["chain"])
        self.c_range = (self.base.context[0], self.base.context[-1])

    def __call__(self, k: int, context: int) -> float:
        cc = min(max(context, self.c_range[0]), self.c_range[1])
        one = self.base(1, cc)
        return self.main(1, context) * self.tree(max(1, k), cc) / one if one > 0 else self.main(k, context)


class EagleTreeForward:
    """An eagle head's tree-shaped forward over k nodes: ``forward[1, c] · batch(1, k) / batch(1, 1)``.

    The main table times the head's chain step (the LM head over the last pair only); a tree
    expansion needs every node's logits, and over a 49k vocabulary the LM head is most of a
    one-layer head's cost: the serial tree's draft phase was predicted 57 % short. The head's
    batched table (B requests x 1 token: the layer over B rows, the LM head over B rows) is that
    forward's shape in rows; it is read at k rows, at the main table's one-token level."""

    def __init__(self, main: Table2D, batch: Table2D) -> None:
        self.main, self.batch = main, batch

    def __call__(self, k: int, context: int) -> float:
        one = self.batch(1, 1)
        return self.main(1, context) * self.batch(1, max(1, k)) / one if one > 0 else self.main(k, context)


def sampling_extra(model: dict[str, Any], mode: str) -> float | None:
    """Seconds per distribution that `mode` costs beyond what the model's forward tables
    include (their class's own mode); None when the profile did not measure sampling."""
    node = model.get("sampling")
    if not node or mode not in node.get("seconds", {}):
        return None
    base = "greedy" if mode == "greedy" else "temperature"
    return max(0.0, float(node["seconds"][mode]) - float(node["seconds"].get(base, 0.0)))
