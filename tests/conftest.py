"""Shared fixtures: compose an experiment exactly as `python -m testbed` would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testbed.compose import compose_experiment
from testbed.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose_exp(*overrides: str) -> ExperimentConfig:
    return compose_experiment(overrides)


def run_cli(*args: str, module: str = "testbed", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
