"""What tests of multi-process runs assert when they end: no spawned worker is left, and the
run's promised files."""

from __future__ import annotations

from pathlib import Path

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


def live_descendants(before: set[int] = frozenset()) -> list[psutil.Process]:  # type: ignore[assignment]
    """Every process this test process started, directly or not, that is still alive (zombies
    and multiprocessing's resource tracker excluded), except the pids in ``before``: a
    torchrun's agents and ranks are not spawn workers, so ``live_workers`` would miss them."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if (p.pid not in before and p.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(p.cmdline())):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_promised_files(run_dir: Path, exp, res) -> None:  # type: ignore[no-untyped-def]
    """The files the README's table promises a real run, whatever its schedule: run_info.json
    (with the telemetry summary) and telemetry.parquet (CPU and RSS samples)."""
    import json

    import pandas as pd

    from testbed.results import write_run

    write_run(run_dir, exp, res)
    info = json.loads((run_dir / "run_info.json").read_text())
    assert "samples" in info["telemetry"]
    tele = pd.read_parquet(run_dir / "telemetry.parquet")
    assert {"t_s", "cpu_percent", "rss_mb"} <= set(tele.columns)
    assert len(tele) == info["telemetry"]["samples"]
