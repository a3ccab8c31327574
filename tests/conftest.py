"""Shared fixtures: compose an experiment exactly as `python -m testbed` would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from testbed.config import ExperimentConfig, pairs_named, register_configs, to_experiment, validate

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose_exp(*overrides: str) -> ExperimentConfig:
    # only the pairs named (Hydra copies the whole ConfigStore on every composition)
    register_configs(pairs_named(overrides))
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    exp = validate(to_experiment(cfg))
    if not exp.pair.name or exp.pair.name == "+":
        exp.pair.name = f"{exp.pair.target.name}+{exp.pair.draft.name}"
    return exp


def run_cli(*args: str, module: str = "testbed", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
