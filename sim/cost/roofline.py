"""`sim.cost_model=roofline`: forward latency from the architecture and the hardware datasheet.

The physics is in ``sim.cost.roofline_forward``; this class binds it to one experiment and makes a call cheap.
For a fixed (role, tokens, layers) a forward is a convex piecewise-affine function of the context
length (each op is max(memory line, compute line) in the context). The first call for a key
precomputes the crossover points and the intercept/slope of every piece; later calls are a
dict lookup, a bisect and one multiply-add, and give the same value as ``forward_cost`` (up to
float rounding), not an approximation.

Roles: target = pair.target on placement.target_gpus GPUs; draft = pair.draft on
placement.draft_gpus GPUs; an early_exit draft is the target's first `exit_layer` layers plus its
LM head, on the target's GPUs (it shares the target's weights); an ngram draft costs a constant.
"""

from __future__ import annotations

from bisect import bisect_right

from sim.cost.base import CostModel, ForwardCost, Role, register
from sim.cost.roofline_forward import (
    DEFAULT_CALIBRATION,
    Calibration,
    Op,
    early_exit_model,
    evaluate,
    forward_ops,
)
from testbed.config import ExperimentConfig, ModelConfig
from testbed.schedules import spec_of

NGRAM_FORWARD_S = 10e-6  # prompt lookup on the host: a hash-table probe, no GPU work

# (breakpoints, intercepts, slopes): piece i covers [breaks[i-1], breaks[i]) of the context
Piecewise = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]


def piecewise(ops: list[Op], launch_s: float) -> Piecewise:
    """Exact piecewise-affine form of sum(op.count * op.seconds(context)) for context >= 0."""
    const, dynamic, breaks = 0.0, [], set()
    for op in ops:
        if op.bytes_ctx == 0.0 and op.flops_ctx == 0.0:
            const += op.count * op.seconds(0, launch_s)
            continue
        const += op.count * (op.kernels * launch_s + op.fixed_s)
        mem = (op.bytes0 / op.bw, op.bytes_ctx / op.bw)
        comp = (op.flops0 / op.peak, op.flops_ctx / op.peak)
        dynamic.append((op.count, mem, comp))
        if mem[1] != comp[1]:
            x = (comp[0] - mem[0]) / (mem[1] - comp[1])
            if x > 0:
                breaks.add(x)
    bs = sorted(breaks)
    probes = [b / 2 for b in bs[:1]] + [(a + b) / 2 for a, b in zip(bs, bs[1:])]
    probes.append(2 * bs[-1] + 1 if bs else 0.0)
    icpt, slope = [], []
    for x in probes:  # in each piece the larger line of every op is fixed: sum those
        a, s = const, 0.0
        for count, mem, comp in dynamic:
            line = mem if mem[0] + mem[1] * x >= comp[0] + comp[1] * x else comp
            a, s = a + count * line[0], s + count * line[1]
        icpt.append(a)
        slope.append(s)
    return tuple(bs), tuple(icpt), tuple(slope)


class RooflineCost(CostModel):
    """Roofline forward latency of the experiment's target and draft (see module docstring)."""

    def __init__(self, exp: ExperimentConfig, cal: Calibration = DEFAULT_CALIBRATION) -> None:
        t, d, pl = exp.pair.target, exp.pair.draft, exp.placement
        self.hw, self.cal = exp.hardware, cal
        self._launch_s = self.hw.gpu.launch_us * 1e-6
        draft: tuple[ModelConfig, int] | None
        if d.kind == "ngram":
            draft = None
        elif d.kind == "early_exit":
            draft = (early_exit_model(t, d.exit_layer), pl.target_gpus)
        elif d.kind == "eagle" and spec_of(exp).serial:  # beside the target, whose features it reads
            draft = (d, pl.target_gpus)
        else:
            draft = (d, pl.draft_gpus)
        self.models: dict[str, tuple[ModelConfig, int] | None] = {
            "target": (t, pl.target_gpus), "draft": draft}
        self._memo: dict[tuple[str, int, tuple[int, int] | None], Piecewise] = {}
        for m in self.models.values():  # bad hardware/model fails here, not mid-simulation
            if m is not None:
                forward_ops(m[0], self.hw, tp=m[1], tokens=1, layers=None, cal=cal)

    def _ops(self, role: Role, tokens: int, layers: tuple[int, int] | None) -> list[Op] | None:
        spec = self.models[role]
        if spec is None:
            return None
        return forward_ops(spec[0], self.hw, tp=spec[1], tokens=tokens, layers=layers, cal=self.cal)

    def forward(self, role: Role, tokens: int, context: int,
                layers: tuple[int, int] | None = None) -> float:
        key = (role, tokens, layers)
        pw = self._memo.get(key)
        if pw is None:
            ops = self._ops(role, tokens, layers)
            pw = ((), (NGRAM_FORWARD_S,), (0.0,)) if ops is None else piecewise(ops, self._launch_s)
            self._memo[key] = pw
        breaks, icpt, slope = pw
        i = bisect_right(breaks, context) if breaks else 0
        return icpt[i] + slope[i] * context

    def breakdown(self, role: Role, tokens: int, context: int,
                  layers: tuple[int, int] | None = None) -> ForwardCost:
        ops = self._ops(role, tokens, layers)
        if ops is None:
            return ForwardCost(total_s=NGRAM_FORWARD_S, other_s=NGRAM_FORWARD_S)
        return evaluate(ops, self.hw, context)


register("roofline")(RooflineCost)
