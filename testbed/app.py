"""`python -m testbed`: the Hydra application.

Compose → validate → run the chosen backend → write the run directory → (per-run report) →
print a short summary. Backends are reached through testbed.backends (a registry the backend
packages fill when imported by name), so `testbed` imports no module of `sim` or `real`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from testbed import backends
from testbed.config import ConfigError, ExperimentConfig, register_configs, to_experiment, validate
from testbed.recorder import RunResult
from testbed.results import write_run

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def run_backend(exp: ExperimentConfig) -> RunResult:
    return backends.get(exp.backend).run(exp)


def is_user_error(e: Exception) -> bool:
    """Errors whose message names the bad setting and the fix (no traceback for those)."""
    return isinstance(e, (ConfigError, *backends.user_error_types()))


def print_summary(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v: object, nd: int = 3) -> str:
        return "—" if v is None else (f"{v:,.{nd}f}" if isinstance(v, float) else str(v))

    t = Table(title=f"{summary['backend']} · {summary['schedule']} · {summary['pair']} · "
                    f"{summary['hardware']} (target {summary['target_gpus']} GPU, "
                    f"draft {summary['draft_gpus']}, γ={summary['gamma']})")
    for col in ("tokens/s", "TPOT ms", "speedup vs ar", "α", "mean accepted len", "prefill s"):
        t.add_column(col, justify="right")
    t.add_row(fmt(summary["tokens_per_s"], 1), fmt(summary["tpot_ms"], 2), fmt(summary["speedup"], 3),
              fmt(summary["alpha"], 3), fmt(summary["mean_accepted_len"], 3), fmt(summary["prefill_s"], 4))
    Console(width=120).print(t)
    if summary.get("tree_shape"):  # trees: tokens per verification is the acceptance figure
        print(f"tree {summary['tree_shape']}: {summary['mean_accepted_len']:.3f} tokens per verification")
    print(f"run directory: {run_dir}")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        exp = validate(to_experiment(cfg))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    hc = HydraConfig.get()
    if not exp.pair.name or exp.pair.name == "+":
        exp.pair.name = hc.runtime.choices.get("pair", "")
    run_dir = Path(hc.runtime.output_dir)
    if exp.calibrate:  # `+calibrate`: write the latency profile instead of a run
        calibrate = backends.get(exp.backend).calibrate
        assert calibrate is not None  # validate() allows +calibrate only on backends that measure
        calibrate(exp, run_dir)
        return None
    try:
        result = run_backend(exp)
    except Exception as e:  # a user-actionable setup error: one line, exit 2, nothing written
        # errors with an `exit_code` (a failed worker: real.errors.WorkerFailed) print one line too
        code = 2 if is_user_error(e) else getattr(e, "exit_code", None)
        if code is None:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(code) from None
    if result.extra.get("writer") is False:  # torchrun: only rank 0 writes the run directory
        return None
    summary = write_run(run_dir, exp, result)
    if exp.report.per_run:
        from testbed.report import build_report

        build_report([run_dir], run_dir)
    if hc.mode is None or str(hc.mode) != "RunMode.MULTIRUN":
        print_summary(summary, run_dir)
    return summary.get("tokens_per_s")
