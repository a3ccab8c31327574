"""The grids of a multirun: the sweep parameters of each grid it runs, and how many jobs a
GridsSweeper sweep (hydra_plugins/specbed_sweeper) has, for the pre-run check
(testbed.app.preflight) before Hydra starts any job."""

from __future__ import annotations

from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


def grid_job_count(cfg: Any, args: list[str]) -> int:
    """The number of jobs of a GridsSweeper sweep (hydra_plugins/specbed_sweeper: `+sweep=validate`,
    `+sweep=gpu_split`), 0 for Hydra's basic sweeper; only its base grid is checked above."""
    sw = cfg.hydra.sweeper
    if "GridsSweeper" not in str(sw.get("_target_", "")):
        return 0
    from hydra_plugins.specbed_sweeper.grids_sweeper import GridsSweeper

    try:
        only = OmegaConf.to_container(sw, resolve=True).get("only")
    except OmegaConfBaseException:  # an interpolation only a running Hydra resolves: count unknown
        return 0
    try:
        sweeper = GridsSweeper(params=dict(sw.get("params") or {}),
                               grids=OmegaConf.to_container(sw.grids) if sw.get("grids") else {}, only=only)
    except ValueError:  # e.g. +sweep=gpu_split on hardware it has no grid for: the caller's line
        raise
    parser = OverridesParser.create()
    cli = [a for a in args if "=" in a and not a.startswith(("+sweep=", "hydra."))]
    parsed = parser.parse_overrides([f"{k}={v}" for k, v in sweeper.params.items()] + cli)
    return sum(len(batch) for batch in sweeper.split_arguments(parsed, None))


def sweep_grids(sweeper: Any) -> list[dict[str, Any]]:
    """The sweep parameters of every grid a multirun runs: ``params``, and with the grids sweeper
    (hydra_plugins.specbed_sweeper) each grid of ``grids`` chosen by ``only`` over them."""
    params = dict(sweeper.get("params") or {})
    grids = {k: dict(g) for k, g in (sweeper.get("grids") or {}).items() if g}
    only = list(sweeper.get("only") or []) or None
    out = [params] if only is None or "base" in only else []
    out += [{**params, **g} for name, g in grids.items() if only is None or name in only]
    return out or [params]
