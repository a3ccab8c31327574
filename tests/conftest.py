"""Shared fixtures: compose an experiment exactly as `python -m testbed` would."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.compose import compose_experiment
from testbed.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


_COMPOSED: dict[tuple[str, ...], ExperimentConfig] = {}


def compose_exp(*overrides: str) -> ExperimentConfig:
    """``compose_experiment(overrides)``. Hydra takes ~0.3 s a composition and the suite asks for
    the same command lines again and again, so each is composed once per session and every
    call gets a deep copy (a test may change its own). A command line naming a DISCO classifier
    (``lookahead.path``) is composed every time: validation reads that file (no other)."""
    if any(o.lstrip("+~").startswith("lookahead.path=") for o in overrides):
        return compose_experiment(overrides)
    if overrides not in _COMPOSED:
        _COMPOSED[overrides] = compose_experiment(overrides)
    return copy.deepcopy(_COMPOSED[overrides])


def run_cli(*args: str, module: str = "testbed", timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _one_intra_op_thread(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Torch runs on one intra-op thread in the test process (not in the runs and workers a test
    starts as processes of their own: they pick their threads as they would outside a test).

    On this project's 2-core hosts, shared with other work, a second intra-op thread waits for
    the busy core at every parallel region: a bundled-model test ran 57 s at torch's default 2
    threads against 22 s at one while another process held a core, and tiny-model tests (ops on
    a few hundred values) lose milliseconds a call. Tests marked ``torch_threads`` keep torch's
    default (the native kernels' tests: their multi-threaded split is what they check)."""
    if request.node.get_closest_marker("torch_threads") is not None:
        yield
        return
    from tests.helpers.spec_oracle import single_thread

    with single_thread():
        yield
