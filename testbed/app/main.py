"""`python -m testbed`: the Hydra application.

Compose → validate → run the chosen backend → write the run directory → (per-run report) →
print a short summary. Backends are reached through testbed.backends (a registry the backend
packages fill when imported by name), so `testbed` imports no module of `sim` or `real`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from testbed import backends
from testbed.app import sweeps
from testbed.compose import to_experiment
from testbed.config import ConfigError, ExperimentConfig
from testbed.config_validate import validate
from testbed.paths import CONF_DIR  # noqa: E402
from testbed.recorder import RunResult
from testbed.results import write_run


def run_backend(exp: ExperimentConfig) -> RunResult:
    return backends.get(exp.backend).run(exp)


def is_user_error(e: Exception) -> bool:
    """Errors whose message names the bad setting and the fix (no traceback for those)."""
    return isinstance(e, (ConfigError, *backends.user_error_types()))


def devices_word(summary: dict) -> str:
    """'GPU' on modelled GPUs and CUDA; 'core' for a real run on this CPU (a device is a core)."""
    return "core" if summary.get("backend") == "real" and summary.get("hardware") == "local" else "GPU"


def print_summary(summary: dict, run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v: object, nd: int = 3) -> str:
        return "—" if v is None else (f"{v:,.{nd}f}" if isinstance(v, float) else str(v))

    unit = devices_word(summary)
    n_t, n_d = summary["target_gpus"], summary["draft_gpus"]
    shape = summary.get("tree_shape")  # a tree has no γ: its shape is what was set
    setting = f"tree {shape}" if shape else f"γ={summary['gamma']}"
    nodes = int(summary.get("nodes") or 1)
    # a pipeline over nodes (decentralized): how many, each stage's devices, and its links
    stages = f"{nodes} nodes × " if nodes > 1 else ""
    links = (f", {float(summary.get('latency_ms') or 0):g} ms links"
             if nodes > 1 and summary.get("latency_ms") is not None else "")
    t = Table(title=f"{summary['backend']} · {summary['schedule']} · {summary['pair']} · "
                    f"{summary['hardware']} ({stages}target {n_t} {unit}{'s' if n_t != 1 else ''}, "
                    f"draft {n_d}, {setting}{links})")
    for col in ("tokens/s", "TPOT ms", "speedup vs ar", "α",
                "tokens/verification" if shape else "mean accepted len", "prefill s"):
        t.add_column(col, justify="right")
    t.add_row(fmt(summary["tokens_per_s"], 1), fmt(summary["tpot_ms"], 2), fmt(summary["speedup"], 3),
              fmt(summary["alpha"], 3), fmt(summary["mean_accepted_len"], 3), fmt(summary["prefill_s"], 4))
    Console(width=120).print(t)
    if summary.get("throughput_tok_s") is not None:  # under load (testbed/arrivals.py)
        load = (f"{summary['rate']:g} requests/s" if summary.get("rate") is not None
                else f"{summary.get('concurrency')} clients" if summary.get("concurrency") is not None
                else "the trace's arrivals")
        u = Table(title=f"under load: {load}, mean batch {fmt(summary['mean_batch'], 1)}, "
                        f"{fmt(summary.get('mean_in_flight'), 1)} in flight")
        for col in ("", "mean", "p50", "p90", "p99"):
            u.add_column(col, justify="right")
        for key, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("e2e_ms", "end-to-end ms")):
            u.add_row(label, *(fmt(summary[f"{key}_{p}"], 1) for p in ("mean", "p50", "p90", "p99")))
        Console(width=120).print(u)
        print(f"throughput {fmt(summary['throughput_tok_s'], 1)} tokens/s ({fmt(summary['load_speedup'], 3)}× ar's "
              f"at this load; ar's P50 TPOT / this one's {fmt(summary['tpot_speedup'], 3)}), goodput "
              f"{fmt(summary['goodput_req_s'], 3)} requests/s ({fmt(summary['slo_attainment'], 3)} within the SLOs), "
              f"queueing {fmt(summary['queue_ms_mean'], 1)} ms on average")
    if summary.get("tree_shape"):  # trees: tokens per verification is the acceptance figure
        print(f"tree {summary['tree_shape']}: {summary['mean_accepted_len']:.3f} tokens per verification")
    if summary.get("pass_at_1") is not None:  # workload.exec_tests=true: HumanEval's tests executed
        print(f"pass@1 {summary['pass_at_1']:.3f}" + ("" if summary.get("pass_at_1_baseline") is None
                                                     else f" (ar baseline {summary['pass_at_1_baseline']:.3f})"))
    print(f"run directory: {run_dir}")


def remove_unstarted_run_dir(run_dir: Path) -> None:
    """A run that never started leaves nothing: Hydra's .hydra/ and log go, then the directory
    (and its empty date folder) if nothing else is in it. A finished run's files are kept."""
    if (run_dir / "summary.json").exists():
        return
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    for log in run_dir.glob("*.log"):
        log.unlink(missing_ok=True)
    for d in (run_dir, run_dir.parent):
        try:
            d.rmdir()
        except OSError:
            break


def is_multirun() -> bool:
    return str(HydraConfig.get().mode) == "RunMode.MULTIRUN"


def run_single(cfg: DictConfig) -> None:
    """A single run from the configuration the pre-run check composed: Hydra's own `run_job`
    (run directory, .hydra/ files, callbacks), without composing everything a second time."""
    from hydra.core.utils import run_job
    from hydra.types import HydraContext, RunMode
    from omegaconf import open_dict, read_write

    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.mode = RunMode.RUN
    callbacks = _callbacks(cfg)
    callbacks.on_run_start(config=cfg, config_name="config")
    ret = run_job(task_function=task, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None,
                  hydra_context=HydraContext(config_loader=None, callbacks=callbacks),  # type: ignore[arg-type]
                  configure_logging=False)
    callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
    _ = ret.return_value  # re-raises what the task raised


def _callbacks(cfg: DictConfig):  # type: ignore[no-untyped-def]
    from hydra._internal.callbacks import Callbacks  # what hydra.main builds (hydra 1.3)

    return Callbacks(cfg)


def task(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = is_multirun()
    try:
        exp = validate(to_experiment(cfg))
        if not exp.pair.name or exp.pair.name == "+":
            exp.pair.name = hc.runtime.choices.get("pair", "")
        if multirun and sweeps.already_done(run_dir, exp):
            sweeps.job_finished(run_dir, skipped=True)
            return None
        if exp.calibrate:  # `+calibrate`: write the latency profile instead of a run
            calibrate = backends.get(exp.backend).calibrate
            assert calibrate is not None  # validate() allows +calibrate only where it measures
            calibrate(exp, run_dir)
            return None
        with sweeps.real_run_lock(exp, run_dir):
            result = run_backend(exp)
        if result.extra.get("writer") is False:  # torchrun: only rank 0 writes the run directory
            return None
        # the hash before the results: summary.json, written last, marks the job finished
        (run_dir / "summary.json").unlink(missing_ok=True)
        sweeps.store_hash(run_dir, exp)
        summary = write_run(run_dir, exp, result)
    except Exception as e:
        if multirun:  # one failing job is reported by the sweep; the others go on
            sweeps.job_failed(run_dir, e, user_error=is_user_error(e))
            return None
        # a user-actionable error: one line, exit 2; a failed worker (real.errors.WorkerFailed)
        # carries its own exit code and prints one line too
        code = 2 if is_user_error(e) else getattr(e, "exit_code", None)
        if code is None:
            raise
        print(f"error: {e}", file=sys.stderr)
        remove_unstarted_run_dir(run_dir)
        raise SystemExit(code) from None
    if exp.report.per_run:
        from testbed.report import build_report

        build_report([run_dir], run_dir, figures=exp.report.figures)
    if multirun:
        sweeps.job_finished(run_dir)
    else:
        print_summary(summary, run_dir)
    return summary.get("tokens_per_s")


main = hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")(task)
