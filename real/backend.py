"""The real backend's entry in testbed's backend registry (testbed.backends): the mirror of
sim/backend.py. Hooks import their modules when called, so registering stays cheap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from real.errors import USER_ERRORS
from testbed.backends import Backend, register
from testbed.config import ExperimentConfig


def run(exp: ExperimentConfig) -> Any:
    from real.engine import run as execute

    return execute(exp)


def calibrate(exp: ExperimentConfig, run_dir: Path) -> Any:
    from real.calibrate import calibrate as measure

    return measure(exp, run_dir)


def tokenizer() -> Any:
    from real.tokenizer import load_bundled_tokenizer

    return load_bundled_tokenizer()


BACKEND = register(Backend(name="real", run=run, calibrate=calibrate, user_errors=USER_ERRORS,
                           tokenizer=tokenizer))
