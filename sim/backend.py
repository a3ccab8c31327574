"""The simulator's entry in testbed's backend registry (testbed.backends): the mirror of
real/backend.py. Hooks import their modules when called, so registering stays cheap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.cost.base import COST_MODELS
from sim.oracle.base import ORACLES
from testbed.backends import Backend, register
from testbed.config import ExperimentConfig


def run(exp: ExperimentConfig) -> Any:
    from sim.runtime.engine import run as simulate

    return simulate(exp)


def replay_seconds(exp: ExperimentConfig, run_dir: Path) -> dict[int, float]:
    """The profile cost model's decode time per request of a recorded run's own rounds."""
    from sim.cost.profile import ProfileCost

    return ProfileCost(exp).decode_seconds(run_dir)


def preload() -> None:
    """Everything a simulated run imports on first use: the engine, the synthetic oracle and
    every schedule (most import torch: 2 s that a sweep worker would pay inside its first job)."""
    import sim.oracle.synthetic  # noqa: F401
    import sim.runtime.engine  # noqa: F401
    from sim.schedules import get_schedule
    from testbed.schedules import implementations

    for impl in implementations("sim"):
        get_schedule(impl)


BACKEND = register(Backend(name="sim", run=run, replay_seconds=replay_seconds, preload=preload,
                           options={"sim.cost_model": COST_MODELS, "acceptance": ORACLES}))
