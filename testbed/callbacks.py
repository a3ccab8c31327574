"""Hydra callbacks: one comparison report over all jobs when a multirun ends."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepReport(Callback):
    """Builds report.md/html + figures in the sweep directory from every finished job."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from testbed.report import build_report

        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            report = build_report([sweep_dir], sweep_dir)
        except FileNotFoundError as e:
            print(f"error: no report: {e}", file=sys.stderr)
            return
        print(f"sweep report: {report}")
