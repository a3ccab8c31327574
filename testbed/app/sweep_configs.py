"""A sweep job's configuration, composed once per set of config-group choices.

Hydra's launchers (basic, joblib, submitit) compose every job from scratch
(``ConfigLoaderImpl.load_sweep_config``: the defaults tree, ~25 YAML files, the merges): ~0.1 s
a job on this machine, most of a simulated job's time (`+sweep=wan`: 60 jobs, 4 compositions of
work for every one of simulation). Jobs that differ only in plain values (`schedule.tau=0,0.2`,
`network.latency_ms=0,5,20`) share their composition up to the point where Hydra applies those
values: this loader composes the group choices once, and for each job applies its values to a
copy (~4 ms) and sets what Hydra derives from a job's overrides (`hydra.overrides.task`,
`hydra.job.override_dirname`). A job with a Hydra override, an addition or a deletion is
composed by Hydra itself. `tests/testbed/app/test_sweep_job_configs.py` holds jobs of every bundled sweep
to Hydra's own composition.

GridsSweeper (hydra_plugins/specbed_sweeper) installs it for every launcher and checks its jobs
with it. The cache lives in
the process, in this module: a joblib worker keeps it across its jobs (the loader itself travels
pickled with every job, and Hydra's plugin scan re-executes the modules of ``hydra_plugins`` in
every job, so it cannot live there); ``sweep_id`` keys it to one sweep, so two sweeps in one
process (tests) never share it.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

_compositions: dict[tuple[Any, ...], DictConfig] = {}  # (sweep id, config, group choices) -> cfg
MAX_CACHED = 64  # compositions kept per process (a sweep has few sets of group choices)


class GroupCachedConfigLoader(ConfigLoaderImpl):
    """Hydra's config loader whose ``load_sweep_config`` reuses one composition per distinct set
    of group choices (everything else is the wrapped loader's)."""

    def __init__(self, inner: ConfigLoaderImpl) -> None:  # noqa: D107 — a copy, not a new search
        self.__dict__.update(inner.__dict__)
        self.sweep_id = uuid.uuid4().hex

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        parsed = OverridesParser.create(config_loader=self).parse_overrides(list(sweep_overrides))
        is_group = [self._is_group_choice(o) for o in parsed]
        groups = [o for o, g in zip(parsed, is_group) if g]
        values = [o for o, g in zip(parsed, is_group) if not g]
        if any(o.is_hydra_override() or o.is_sweep_override() for o in parsed) or any(
                o.is_add() or o.is_force_add() or o.is_delete() for o in values):
            return super().load_sweep_config(master_config, sweep_overrides)
        key = (self.sweep_id, master_config.hydra.job.config_name, tuple(o.input_line for o in groups))
        if key not in _compositions:
            if len(_compositions) >= MAX_CACHED or any(k[0] != self.sweep_id for k in _compositions):
                _compositions.clear()
            _compositions[key] = super().load_sweep_config(master_config, [o.input_line or "" for o in groups])
        cfg = copy.deepcopy(_compositions[key])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        # what Hydra derives from the job's own overrides (config_loader_impl._load_configuration_impl)
        cfg.hydra.overrides.task = [o.input_line for o in parsed]
        od = cfg.hydra.job.config.override_dirname
        cfg.hydra.job.override_dirname = get_overrides_dirname(
            overrides=parsed, kv_sep=od.kv_sep, item_sep=od.item_sep, exclude_keys=od.exclude_keys)
        OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
        return cfg

    def _is_group_choice(self, override: Override) -> bool:
        # as Hydra's defaults list tells group overrides from config overrides
        return override.package is not None or self.repository.group_exists(override.key_or_group)
