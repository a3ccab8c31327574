"""An experiment composed from conf/ with Hydra: the schema and the `pair=TARGET+DRAFT`
combinations registered in Hydra's ConfigStore, the ``default_gpus`` resolver of the placement
defaults, and the composed config turned into the plain dataclasses of testbed/config.py."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from omegaconf import DictConfig, OmegaConf

from testbed.config import ExperimentConfig
from testbed.config_validate import validate
from testbed.paths import CONF_DIR
from testbed.schedules import TWO_GROUPS, find


def default_gpus(role: str, schedule: str, gpus_per_node: int, hardware: str = "") -> int:
    """Placement defaults: every GPU for both models, except a ``two_groups`` schedule
    (`async`), which needs disjoint groups — 3/8 of the node for the draft (SwiftSpec's best Llama-3-70B split is 5+3).
    hardware=local (this machine, simulated or real): one device per group (a device is a core
    on CPU), so a real run stays in one process unless tensor parallelism or an async split is
    asked for, and the simulator predicts the same placement."""
    if hardware == "local":
        return 1
    spec = find(schedule)
    if spec is None or spec.layout != TWO_GROUPS or gpus_per_node < 2:
        return gpus_per_node
    draft = max(1, round(3 * gpus_per_node / 8))
    return draft if role == "draft" else gpus_per_node - draft


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("default_gpus"):
        OmegaConf.register_new_resolver("default_gpus", default_gpus)


def model_presets() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def pairs_named(texts: Iterable[str]) -> set[str]:
    """Every `TARGET+DRAFT` of model presets mentioned in these strings (command-line overrides,
    sweep values): the pair combinations a command may compose."""
    import re

    models = set(model_presets())
    found = set()
    for text in texts:
        for t, d in re.findall(r"([A-Za-z0-9_.-]+)\+([A-Za-z0-9_.-]+)", text):
            if t in models and d in models:
                found.add(f"{t}+{d}")
    return found


def register_configs(pairs: Iterable[str] | None = None) -> None:
    """Register the schema so Hydra type-checks every override against it, and the
    `pair=TARGET+DRAFT` combinations of model presets that have no file in conf/pair/ (files
    take precedence). `pairs=None` registers every combination; the CLI passes the pairs its
    command line and sweep configs name, because Hydra copies the whole ConfigStore on every
    composition (256 pairs made each one take a second)."""

    from hydra.core.config_store import ConfigStore

    register_resolvers()
    cs = ConfigStore.instance()
    if "experiment_schema.yaml" not in cs.repo:
        cs.store(name="experiment_schema", node=ExperimentConfig)
    conf = CONF_DIR
    models = model_presets()
    files = {p.stem for p in (conf / "pair").glob("*.yaml")}
    stored = set(cs.repo.get("pair", {}))
    wanted = [f"{t}+{d}" for t in models for d in models] if pairs is None else sorted(pairs)
    for name in wanted:
        t, _, d = name.partition("+")
        if name not in files and f"{name}.yaml" not in stored:
            cs.store(group="pair", name=name, node={
                "defaults": [{"/model@target": t}, {"/model@draft": d}, "_self_"],
                "name": name})


@functools.cache
def _schema() -> DictConfig:
    """The typed schema, built once (10 ms: half of a job's conversion in a sweep)."""
    return OmegaConf.structured(ExperimentConfig)


def to_experiment(cfg: DictConfig | dict) -> ExperimentConfig:
    """Composed config (OmegaConf) -> plain dataclasses; drops the `hydra` node if present."""
    register_resolvers()
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    net = cfg.get("network")
    if isinstance(net, DictConfig) and "bandwidth_gbps" in net:  # a run recorded before the rename
        cfg = cfg.copy()
        old = cfg.network.pop("bandwidth_gbps")
        cfg.network.bandwidth_gbit_s = 8.0 * float(old)  # it held gigabytes per second
    merged = OmegaConf.merge(_schema(), cfg)  # (merge copies its first argument)
    exp = OmegaConf.to_object(merged)
    assert isinstance(exp, ExperimentConfig)
    if not exp.pair.name:
        exp.pair.name = f"{exp.pair.target.name}+{exp.pair.draft.name}"
    return exp


def compose_experiment(overrides: Iterable[str] = ()) -> ExperimentConfig:
    """The experiment ``python -m testbed OVERRIDES`` runs, composed and validated: for scripts
    (benchmarks, tests) that build runs without the CLI."""
    from hydra import compose, initialize_config_dir

    overrides = list(overrides)
    register_configs(pairs_named(overrides))  # only the pairs named: composing stays fast
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    exp = validate(to_experiment(cfg))
    if not exp.pair.name or exp.pair.name == "+":
        exp.pair.name = f"{exp.pair.target.name}+{exp.pair.draft.name}"
    return exp
