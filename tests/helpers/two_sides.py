"""Both groups of an async run in this process: the draft side on a thread, the target side on
the caller's, over a LoopbackTransport (SGLang-style protocol tests, no processes)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch


def run_both(target: Callable[[], Any], draft: Callable[[], Any], ends: Iterable[Any], *,
             join_s: float = 60.0, after: Callable[[], None] = lambda: None) -> None:
    """``draft`` on a thread and ``target`` here, both in inference mode; then the transport's
    ends are closed and ``after`` runs (whatever happened); a failure of the draft side is raised."""
    errors: list[BaseException] = []

    def drafting() -> None:
        try:
            with torch.inference_mode():
                draft()
        except BaseException as e:  # noqa: BLE001 — raised below
            errors.append(e)

    thread = threading.Thread(target=drafting)
    thread.start()
    try:
        with torch.inference_mode():
            target()
    finally:
        thread.join(join_s)
        for end in ends:
            end.close()
        after()
    assert not errors, errors
