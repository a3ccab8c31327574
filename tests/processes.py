"""What tests of multi-process runs assert when they end: no spawned worker is left."""

from __future__ import annotations

import psutil


def live_workers() -> list[psutil.Process]:
    """Spawned worker interpreters of this test process still alive (zombies and
    multiprocessing's resource tracker excluded)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
