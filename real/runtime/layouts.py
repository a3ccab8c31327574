"""The real backend's runner per layout (testbed.placement): how the processes of a run are
started and what each runs.

- ``single``, ``tree`` (real/runtime/engine.py): one process, or one SPMD group of tensor-parallel ranks
  that all run the schedule's entry from real/schedules;
- ``two_groups`` (real/runtime/async_run.py): a draft group and a target group, each rank running its
  group's half of the schedule, joined by the bridge;
- ``pipeline`` (real/runtime/pipeline_run.py): one process per stage; the first stage drives the
  requests, the others forward activations.

``RUNNERS`` is a ``Registry`` keyed by layout: each runner's module registers it when imported
(``real.runtime.engine.run`` imports the one a run's placement needs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from testbed.registry import Registry
from testbed.schedules import PIPELINE, SINGLE, TREE, TWO_GROUPS


@dataclass(frozen=True)
class Runner:
    """A layout's runner: ``run(exp, placement) -> RunResult``, the placement made once where
    the run starts (``real.runtime.launch.run_placement``). ``launches_per_run``: it starts its
    processes for every run, so ``real.repeats`` repeats whole runs (real/runtime/repeats.py) instead
    of interleaving the schedule and its baseline inside one."""

    run: Callable[[Any, Any], Any]
    launches_per_run: bool = False


RUNNERS: Registry[Runner] = Registry("layout runner")
RUNNERS.declare(SINGLE, "real.runtime.engine")
RUNNERS.declare(TREE, "real.runtime.engine")
RUNNERS.declare(TWO_GROUPS, "real.runtime.async_run")
RUNNERS.declare(PIPELINE, "real.runtime.pipeline_run")
