"""What every real schedule gets: the experiment, the target runner, the draft, the recorder,
the sampling settings and the clock, and the request it serves (the mirror of sim/runtime/context.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from real.model.drafts import Draft
from real.model.runners import TargetRunner
from testbed.config import ExperimentConfig
from testbed.recorder import RunRecorder
from testbed.spec.sampling import SamplingParams


@dataclass(frozen=True)
class RealRequest:
    request_id: int
    prompt_id: str
    prompt_ids: list[int]
    max_new_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class RealContext:
    exp: ExperimentConfig
    target: TargetRunner
    draft: Draft | None
    rec: RunRecorder
    eos: frozenset[int]
    params: SamplingParams
    on_tokens: Callable[[int], None]
    t0: float  # the run's time origin: recorded times are seconds since it
    # summary fields a schedule contributes (merged into RunResult.extra -> summary.json)
    extra: dict[str, Any] = field(default_factory=dict)
    # per-run objects shared by the requests (accumulators), as SimContext.state
    state: dict[str, Any] = field(default_factory=dict)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def generator(self, request_id: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.exp.seed * 1_000_003 + request_id)


def finish(out: list[int], new: list[int], n_max: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """Append ``new`` up to ``n_max`` tokens in total, stopping after an EOS token."""
    for t in new:
        if len(out) >= n_max:
            return out, True
        out.append(t)
        if t in eos:
            return out, True
    return out, len(out) >= n_max
