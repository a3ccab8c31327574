"""The real backend's entry in testbed's backend registry (testbed.backends): the mirror of
sim/backend.py. Hooks import their modules when called, so registering stays cheap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from real.errors import USER_ERRORS
from testbed.backends import Backend, register
from testbed.config import ExperimentConfig


def run(exp: ExperimentConfig) -> Any:
    from real.runtime.engine import run as execute

    result = execute(exp)
    if exp.workload.exec_tests and result.extra.get("writer") is not False:
        result.extra.update(humaneval_pass_at_1(exp, result))
    return result


def humaneval_pass_at_1(exp: ExperimentConfig, result: Any) -> dict[str, Any]:
    """pass@1 of the run's (and its `ar` baseline's) outputs, executed in sandboxed children
    (testbed/humaneval_exec.py); every schedule and layout records its outputs the same way."""
    from real.runtime.loading import load_tokenizer
    from testbed.humaneval_exec import summary_fields

    tokenizer = load_tokenizer(exp.pair.target.path)
    return summary_fields(exp, result.recorder, result.baseline,
                          lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def calibrate(exp: ExperimentConfig, run_dir: Path) -> Any:
    from real.calibrate.profile import calibrate as measure

    return measure(exp, run_dir)


def tokenizer() -> Any:
    from real.model.tokenizer import load_bundled_tokenizer

    return load_bundled_tokenizer()


def probe_forward(exp: ExperimentConfig) -> dict[str, float]:
    from real.calibrate.probe_forward import forward_probe

    return forward_probe(exp)


BACKEND = register(Backend(name="real", run=run, calibrate=calibrate, user_errors=USER_ERRORS,
                           tokenizer=tokenizer, probe_forward=probe_forward))
