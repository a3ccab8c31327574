"""Hydra callbacks of a multirun: progress state at the start; at the end the results table
(results.parquet/.csv) and one comparison report over every job, failures included."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from testbed.app import sweeps

JOBS_ENV = "SPECBED_SWEEP_JOBS"  # set by `python -m testbed` after its pre-run check


REPORT_PARALLEL_FROM = 12  # runs: below, starting report processes costs more than it saves


def report_workers(sweep_dir: Path) -> int:
    """Processes for the sweep report's figures: this process's cores, for a big enough sweep."""
    runs = sum(1 for _ in sweep_dir.glob("*/summary.json"))
    return len(os.sched_getaffinity(0)) if runs >= REPORT_PARALLEL_FROM else 1


class SweepReport(Callback):
    """Builds results.parquet, report.md/html + figures in the sweep directory."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from testbed.app.worker_pool import wait

        wait()  # the joblib workers started by the pre-run check are ready before the launch
        sweeps.start(Path(config.hydra.sweep.dir), int(os.environ.get(JOBS_ENV, "0") or 0))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from testbed.report import ReportError, build_report

        sweep_dir = Path(config.hydra.sweep.dir)
        table = sweeps.write_results(sweep_dir)
        if table is not None:
            print(f"sweep results: {table} (+ results.csv)")
        failed = sweeps.failures(sweep_dir)
        try:
            from testbed.app.worker_pool import parallel_kwargs

            # the figures drawn in the joblib launcher's warm workers when the sweep used them
            report = build_report([sweep_dir], sweep_dir, workers=report_workers(sweep_dir),
                                  pool=parallel_kwargs)
            print(f"sweep report: {report.with_suffix('.html')}")
        except (FileNotFoundError, ReportError) as e:
            print(f"error: no report: {e}", file=sys.stderr)
        from testbed.app.worker_pool import shutdown

        shutdown()
        if failed:
            print(f"error: {len(failed)} job(s) failed (listed in the report and results.csv); "
                  "re-run the same command with the same hydra.sweep.dir to redo only those",
                  file=sys.stderr)
            raise SystemExit(1)
