"""Cost models: how long one forward of the draft or the target takes in the simulator.

A cost model is bound to one experiment (pair, hardware, placement) when it is built, and answers
``forward(role, tokens, context, layers)`` in seconds. ``tokens`` is the number of tokens in the
forward (k: 1 for AR decode, γ+1 for a verification, w for a tree expansion, the prompt for
prefill), ``context`` the number of tokens already in the KV cache, ``layers`` an optional
half-open layer range [lo, hi) for a pipeline stage (None = all layers).

Registry keyed by ``sim.cost_model``: analytic (Leviathan's assumptions), roofline (from the
architecture and the hardware datasheet), profile (tables measured by the real backend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from testbed.config import ExperimentConfig
from testbed.registry import Registry

Role = Literal["target", "draft"]


@dataclass(frozen=True)
class ForwardCost:
    """One forward's modelled time and where it goes (seconds)."""

    total_s: float
    weights_s: float = 0.0  # streaming weights from memory (or their GEMM compute if bound)
    attention_s: float = 0.0  # reading/writing the KV cache, attention math
    allreduce_s: float = 0.0  # tensor-parallel all-reduce (α–β)
    launch_s: float = 0.0  # kernel launch / minimum kernel latency
    other_s: float = 0.0  # norms, embeddings, LM head, sampling


class CostModel(ABC):
    """Forward latency of the experiment's draft and target."""

    @abstractmethod
    def forward(self, role: Role, tokens: int, context: int,
                layers: tuple[int, int] | None = None) -> float:
        """Seconds for one forward of `tokens` tokens over `context` cached tokens."""

    def draft_chain(self, pending: int, forwards: int, seq_len: int) -> float:
        """Seconds of a chain draft phase: one forward over the ``pending`` tokens fed first (the
        sequence then holds ``seq_len``), then ``forwards`` − 1 one-token forwards."""
        t = self.forward("draft", pending, seq_len - pending)
        for i in range(1, forwards):
            t += self.forward("draft", 1, seq_len + i - 1)
        return t

    def batch_forward(self, role: Role, rows: Sequence[tuple[int, int]], *, tree: bool = False) -> float:
        """Seconds for one forward over several requests at once (continuous batching): ``rows``
        holds each request's (tokens, cached context). The weights are streamed once for all
        rows — the forward of the rows' total tokens over no context — and each request adds its
        own attention over its own cache: its forward's growth from no context to its context.
        One row is exactly ``forward`` (``tree``: ``tree_forward``, tree-masked rows)."""
        fwd = self.tree_forward if tree else self.forward
        if len(rows) == 1:
            return fwd(role, rows[0][0], rows[0][1])
        t = fwd(role, sum(k for k, _ in rows), 0)
        for tokens, context in rows:
            t += fwd(role, tokens, context) - fwd(role, tokens, 0)
        return t

    def tree_forward(self, role: Role, tokens: int, context: int, alone: bool = False) -> float:
        """Seconds for one tree-masked forward of `tokens` tree nodes over `context` cached
        slots (a draft expansion, a tree verification). Models that do not tell the shapes
        apart charge the chain-shaped forward. ``alone``: without the other group's
        contention (a model that charges contention leaves it out)."""
        return self.forward(role, tokens, context)

    def tree_expand_extra(self, leaves: int) -> float:
        """Seconds a draft tree expansion of ``leaves`` leaves spends beyond its forward
        (distributions over the vocabulary, picking children, growing the tree). Models that
        did not measure it charge nothing."""
        return 0.0

    def tree_round_bookkeeping(self, leaves: int) -> tuple[float, float]:
        """Seconds of a token tree's per-round draft bookkeeping on a tree of width ``leaves``
        (the serial tree and `async`): (select + pack the subtree, re-root + KV compaction).
        Models that did not measure it charge nothing."""
        return 0.0, 0.0

    def breakdown(self, role: Role, tokens: int, context: int,
                  layers: tuple[int, int] | None = None) -> ForwardCost:
        return ForwardCost(total_s=self.forward(role, tokens, context, layers))

    def prefill(self, role: Role, prompt_len: int) -> float:
        return self.forward(role, prompt_len, 0)


class AnalyticCost(CostModel):
    """Leviathan et al. §3.3: a target forward costs T for any k <= γ+1, a draft forward c·T.

    A pipeline stage of a decentralized target costs its share of T (layers/total)."""

    def __init__(self, exp: ExperimentConfig) -> None:
        self.t_target = exp.sim.t_target_ms / 1e3
        self.c = exp.sim.c
        self.target_layers = max(exp.pair.target.layers, 1)

    def forward(self, role: Role, tokens: int, context: int,
                layers: tuple[int, int] | None = None) -> float:
        if role == "draft":
            return self.c * self.t_target
        if layers is None:
            return self.t_target
        return self.t_target * (layers[1] - layers[0]) / self.target_layers

    def prefill(self, role: Role, prompt_len: int) -> float:
        # Theorem 3.8 ignores prefill; model it as one forward so prefill_s is not zero.
        return self.forward(role, prompt_len, 0)


# the values of sim.cost_model: roofline and profile register themselves when first used
COST_MODELS: Registry[Callable[[ExperimentConfig], CostModel]] = Registry("sim.cost_model")
COST_MODELS.register("analytic", AnalyticCost)
COST_MODELS.declare("roofline", "sim.cost.roofline")
COST_MODELS.declare("profile", "sim.cost.profile")
register = COST_MODELS.register


def make_cost_model(exp: ExperimentConfig) -> CostModel:
    return COST_MODELS.get(exp.sim.cost_model)(exp)
