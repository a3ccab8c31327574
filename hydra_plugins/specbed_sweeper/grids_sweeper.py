"""A Hydra sweeper for sweeps made of several grids (`+sweep=validate`: the chain grid and the
serial-tree grid): Hydra's basic sweeper takes one Cartesian product of ``params``; this one
also runs the product of every extra grid in ``grids``, each ``params`` with some keys replaced
or added. Command-line sweep arguments apply to every grid (and win over its values, as they do
over ``params``). The last key of ``params`` stays the last axis of every grid (validate's roles
must run back to back), with a grid's own values where it sets that key too. ``only``: the names of the grids to run (``params`` is "base"), e.g.
``hydra.sweeper.only=[tree]``; a grid set to null is left out.

It is every sweep's sweeper (conf/config.yaml), also for one grid, for its check of the jobs
before any runs: Hydra composes every job's config up front (0.4 s each here: half a job's time,
and serial — with the joblib launcher it capped the speed-up on 2 cores at ~1.3x). This one
composes once per distinct set of config-group choices and applies each job's plain value
overrides to a copy, which checks the same keys and types in milliseconds; and none at all when
`python -m testbed`'s own pre-run check has already composed every job (``CHECKED_ENV``).

It lives in the ``hydra_plugins`` namespace package because Hydra instantiates sweepers from
there only (conf/hydra/sweeper/grids.yaml selects it).

    hydra:
      sweeper:
        _target_: hydra_plugins.specbed_sweeper.grids_sweeper.GridsSweeper
        params: {a: "1,2", role: "x,y"}
        grids:
          wide: {a: "7", b: "3,4"}        # a=7 x b in 3,4 x role in x,y
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from testbed.app.joblib_jobs import with_shared_state
from testbed.app.sweep_configs import GroupCachedConfigLoader

BASE = "base"
# set by `python -m testbed` when its pre-run check covered every job of every grid
CHECKED_ENV = "SPECBED_SWEEP_CHECKED"


class GridsSweeper(BasicSweeper):
    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None,
                 grids: dict[str, dict[str, Any] | None] | None = None, only: list[str] | None = None) -> None:
        # BasicSweeper.__init__'s attributes, set here: its ``super(BasicSweeper, self)`` fails
        # once Hydra's plugin scan has re-executed basic_sweeper.py (a new BasicSweeper class)
        self.overrides = None
        self.batch_index = 0
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.hydra_context = None
        self.config = None
        self.launcher = None
        self.grids = {name: dict(g) for name, g in (grids or {}).items() if g}
        self.only = list(only) if only else None
        unknown = sorted(set(self.only or []) - {BASE, *self.grids})
        if unknown:
            raise ValueError(f"hydra.sweeper.only={self.only}: no grid named {', '.join(unknown)} "
                             f"(grids: {', '.join([BASE, *self.grids])})")

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        """The basic sweeper's setup, with a config loader that composes each job's group choices
        once (testbed.app.sweep_configs.GroupCachedConfigLoader: the launcher, any launcher, gets it too)."""
        loader = hydra_context.config_loader
        if isinstance(loader, ConfigLoaderImpl) and not isinstance(loader, GroupCachedConfigLoader):
            hydra_context = HydraContext(config_loader=GroupCachedConfigLoader(loader),
                                         callbacks=hydra_context.callbacks)
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.launcher = with_shared_state(self.launcher)  # joblib: the context sent once per worker

    def split_arguments(self, overrides: list[Override], max_batch_size: int | None) -> list[list[list[str]]]:
        """Every grid's jobs (the basic sweeper's product each), duplicates dropped, in batches."""
        loader = self.hydra_context.config_loader if self.hydra_context is not None else None
        parser = OverridesParser.create(config_loader=loader)
        n = len(self.params)  # BasicSweeper.sweep parsed params first, then the command line
        base, cli = overrides[:n], overrides[n:]
        last = base[-1:] if base else []
        chosen = [(BASE, [])] + [(name, parser.parse_overrides([f"{k}={v}" for k, v in g.items()]))
                                 for name, g in self.grids.items()]
        jobs: list[list[str]] = []
        seen: set[tuple[str, ...]] = set()
        for name, extra in chosen:
            if self.only is not None and name not in self.only:
                continue
            # the last axis stays last; a grid that sets that key too puts its own values there
            own = [o for o in extra if last and o.get_key_element() == last[0].get_key_element()]
            rest = [o for o in extra if o not in own]
            ordered = base[:-1] + rest + (own or last) + cli if last else extra + cli
            for job in BasicSweeper.split_arguments(ordered, None)[0]:
                if tuple(job) not in seen:
                    seen.add(tuple(job))
                    jobs.append(job)
        if max_batch_size is None:
            return [jobs]
        return [list(chunk) for chunk in BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size)]

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Compose each distinct set of group choices once; check the value overrides on copies
        (what Hydra's own check does, composing every job: see the module docstring). The
        compositions are the launcher's own (GroupCachedConfigLoader), so its jobs reuse them."""
        if os.environ.get(CHECKED_ENV) == "1":
            return  # `python -m testbed`'s pre-run check has composed and validated every job
            # of every grid that runs (testbed/app/grids.py: sweep_grids)
        loader = self.hydra_context.config_loader if self.hydra_context is not None else None
        if not isinstance(loader, ConfigLoaderImpl) or self.config is None:
            return super().validate_batch_is_legal(batch)
        if not isinstance(loader, GroupCachedConfigLoader):
            loader = GroupCachedConfigLoader(loader)
        for job in batch:
            loader.load_sweep_config(self.config, list(job))
