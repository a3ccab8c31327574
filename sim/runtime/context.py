"""What every simulated schedule gets: the SimPy environment, the cost model, the token oracle,
the recorder, and the request it serves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import simpy

from sim.cost.base import CostModel
from sim.oracle.base import TokenOracle
from testbed.config import ExperimentConfig
from testbed.recorder import RunRecorder


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    prompt_id: str
    prompt_len: int
    max_new_tokens: int


@dataclass
class SimContext:
    exp: ExperimentConfig
    env: simpy.Environment
    cost: CostModel
    oracle: TokenOracle
    rec: RunRecorder
    # summary fields a schedule contributes (merged into RunResult.extra -> summary.json)
    extra: dict[str, Any] = field(default_factory=dict)
    # per-run objects shared by the requests of one simulation (topology, links, accumulators)
    state: dict[str, Any] = field(default_factory=dict)
