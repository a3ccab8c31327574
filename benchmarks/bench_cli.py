"""How long the user waits: the phases of `python -m testbed` and the wall time of commands.

    python benchmarks/bench_cli.py [--only phases|default|help|gpu_split|gpu_split_joblib|wan|wan_joblib]
                                   [--runs 1] [--out FILE.json]
    python benchmarks/bench_cli.py --pairs 5 [--only wan gpu_split]   (joblib's speedup, paired)

*phases*: one fresh process imports the app (and the simulator), runs the pre-run check of the
default run and of the 60-job `+sweep=wan`, simulates the default experiment, writes its run
directory and builds its per-run report, timing each step. *commands*: the wall time of
`python -m testbed` (default run, report included), `--help`, `+sweep=gpu_split` and
`+sweep=wan` (basic launcher, and `hydra/launcher=joblib` when hydra-joblib-launcher is
installed), each the best of `--runs`. Every run writes into a temporary directory. Timings
depend on the machine's load: the load average is printed with them.
SPECBED_ROOT=DIR times another checkout of the project (a before/after pair under the same load).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(os.environ.get("SPECBED_ROOT") or Path(__file__).resolve().parents[1])  # tree to time

PHASES = r"""
import json, sys, time, tempfile
from pathlib import Path
t = time.perf_counter()
out = {}
import testbed.app.main as app
import sim.runtime.engine  # noqa: F401  (the simulator: imported by every simulated run)
out["imports_s"] = time.perf_counter() - t
from testbed.app.preflight import preflight
t = time.perf_counter(); preflight([])
out["preflight_default_s"] = time.perf_counter() - t
t = time.perf_counter(); preflight(["+sweep=wan"])
out["preflight_wan60_s"] = time.perf_counter() - t
from tests.conftest import compose_exp
exp = compose_exp()
t = time.perf_counter(); result = app.run_backend(exp)
out["simulate_s"] = time.perf_counter() - t
from testbed.results import write_run
d = Path(tempfile.mkdtemp())
t = time.perf_counter(); write_run(d, exp, result)
out["write_run_s"] = time.perf_counter() - t
t = time.perf_counter()
from testbed.report import build_report
figures = getattr(exp.report, "figures", None)  # older trees: no such setting, always drawn
build_report([d], d) if figures is None else build_report([d], d, figures=figures)
out["report_s"] = time.perf_counter() - t
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}


def phases() -> dict[str, float]:
    p = subprocess.run([sys.executable, "-c", PHASES], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=600)
    if p.returncode:
        raise SystemExit(f"phases failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def has_joblib_launcher() -> bool:
    try:
        import hydra_plugins.hydra_joblib_launcher  # noqa: F401
    except ImportError:
        return False
    return True


def busy_cpu_s() -> float:
    """CPU seconds the whole host has been busy (user, nice, system, irq) since boot, from
    /proc/stat: a command's own and its descendants' (joblib workers are forked by a fork
    server the command does not wait for, so its rusage misses them), plus other load."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def command_wall(args: list[str], runs: int) -> tuple[float, float]:
    """(best wall seconds, CPU seconds of that run: the host's busy CPU time while it ran,
    a figure the other load of a shared machine inflates less than the wall time)."""
    best, best_cpu = float("inf"), float("nan")
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            extra = [] if "--help" in args else [f"hydra.run.dir={tmp}/run", f"hydra.sweep.dir={tmp}/sweep"]
            before = busy_cpu_s()
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "testbed", *args, *extra], cwd=ROOT, env=_env(),
                               capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - t
            cpu = busy_cpu_s() - before
            if p.returncode:
                raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")
        if wall < best:
            best, best_cpu = wall, cpu
    return best, best_cpu


COMMANDS = {
    "default": [],
    "help": ["--help"],
    "gpu_split": ["+sweep=gpu_split"],
    "gpu_split_joblib": ["+sweep=gpu_split", "hydra/launcher=joblib"],
    "wan": ["+sweep=wan"],
    "wan_joblib": ["+sweep=wan", "hydra/launcher=joblib"],
}


def launcher_pairs(sweeps: list[str], pairs: int) -> dict[str, object]:
    """Each sweep run with the basic then the joblib launcher, ``pairs`` times in a row (A B A B:
    the machine's drift between runs minutes apart hits both alike); the speedup of each pair
    and their median, the figure the goal is read from."""
    import statistics

    if not has_joblib_launcher():
        raise SystemExit("--pairs needs hydra-joblib-launcher")
    out: dict[str, object] = {}
    for name in (n.removesuffix("_joblib") for n in sweeps):
        if name not in ("wan", "gpu_split"):
            continue
        rows = []
        for i in range(pairs):
            basic, _ = command_wall(COMMANDS[name], 1)
            joblib, _ = command_wall(COMMANDS[f"{name}_joblib"], 1)
            rows.append({"basic_s": basic, "joblib_s": joblib, "speedup": basic / joblib})
            print(f"+sweep={name} pair {i + 1}: basic {basic:6.2f} s, joblib {joblib:6.2f} s, "
                  f"{basic / joblib:.2f}x (load {os.getloadavg()[0]:.2f})", flush=True)
        med = statistics.median(r["speedup"] for r in rows)
        print(f"+sweep={name}: joblib speedup, median of {pairs} pairs: {med:.2f}x", flush=True)
        out[name] = {"pairs": rows, "median_speedup": med}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, choices=["phases", *COMMANDS])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=0,
                    help="instead: N interleaved basic/joblib pairs of each sweep in --only "
                         "(wan, gpu_split), and the median of the pairs' speedups")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.pairs:
        results = {"loadavg_start": os.getloadavg()[0],
                   **launcher_pairs(args.only or ["wan", "gpu_split"], args.pairs)}
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        return
    todo = args.only or ["phases", *COMMANDS]
    results: dict[str, object] = {"loadavg_start": os.getloadavg()[0]}
    if "phases" in todo:
        ph = phases()
        results["phases"] = ph
        for k, v in ph.items():
            print(f"phase {k:<22} {v:7.2f} s", flush=True)
    for name, cmd in COMMANDS.items():
        if name not in todo:
            continue
        if name.endswith("_joblib") and not has_joblib_launcher():
            print("python -m testbed +sweep=wan hydra/launcher=joblib: skipped (no hydra-joblib-launcher)")
            continue
        wall, cpu = command_wall(cmd, args.runs)
        results[name] = {"wall_s": wall, "cpu_s": cpu}
        print(f"python -m testbed {' '.join(cmd):<40} {wall:7.2f} s wall {cpu:7.2f} s CPU "
              f"(load {os.getloadavg()[0]:.2f})", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
