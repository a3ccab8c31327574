"""What every simulated schedule gets: the SimPy environment, the cost model, the token oracle,
the recorder, and the request it serves."""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from sim.cost import CostModel
from sim.oracle import TokenOracle
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
