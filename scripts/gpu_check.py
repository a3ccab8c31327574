"""The GPU check: every real schedule on one device, in one run, with one summary.

``scripts/gpu_check.sh`` (which installs the carried wheels first) runs this module. Steps:
the machine (device, CPU flags, measured bandwidth and bf16 GEMM peak), random-weight
checkpoints (``gpu_check_models``), k-token forward times against the roofline (eager and
CUDA-graph replay), then each schedule through the CLI (``python -m testbed backend=real``):
``ar``, ``sync`` at γ 2/4/8, ``sync`` under load (four clients, continuous batching), the serial tree, the lookahead policies that need no trained
weights, ``decentralized`` with two stage processes sharing the device, and ``+calibrate``.
Every run's temperature-0 output must equal ``ar``'s; each is predicted by the simulator from
its own trace (roofline on the device's hardware preset, and the profile after ``+calibrate``).
A time budget skips what would not fit, and says so. Writes ``gpu_check.json`` and
``gpu_check.md`` to ``$OUT`` (or ``--out``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import gpu_check_models as gm  # noqa: E402

REPO = gm.REPO
# (label, overrides) of the real runs after `ar`; each is compared with `ar`'s outputs
RUNS = [  # most telling first: the budget skips from the end
    ("sync g4", ["schedule=sync", "schedule.gamma=4"]),
    ("ar eager", ["schedule=ar", "real.baseline=false", "real.cuda_graphs=false"]),
    ("sync g4 eager", ["schedule=sync", "schedule.gamma=4", "real.cuda_graphs=false"]),
    ("serial tree", ["schedule=sync", "schedule.tree=true", "schedule.gamma=4"]),
    # continuous batching: four clients' requests in one forward (real/model/batch.py, op by op on a GPU)
    ("sync g4 under load", ["schedule=sync", "schedule.gamma=4", "workload.concurrency=4"]),
    ("decentralized N=2", ["schedule=decentralized", "placement.nodes=2", "placement.target_gpus=1",
                           "network=wan", "schedule.gamma=4"]),
    ("sync g2", ["schedule=sync", "schedule.gamma=2"]),
    ("sync g8", ["schedule=sync", "schedule.gamma=8"]),
    ("lookahead heuristic", ["schedule=sync", "lookahead=heuristic", "schedule.gamma=8"]),
    ("lookahead confidence", ["schedule=sync", "lookahead=confidence", "schedule.gamma=8"]),
    ("lookahead oracle", ["schedule=sync", "lookahead=oracle", "schedule.gamma=8"]),
    ("+calibrate", []),  # last: it takes about as long as all the runs before it
]

# the dry run (--tiny): one of each kind, so it stays a couple of minutes on two cores
TINY_RUNS = ("sync g4", "serial tree", "sync g4 under load", "decentralized N=2", "lookahead heuristic")


def workload_overrides(a: argparse.Namespace) -> list[str]:
    """The prompts every run serves (and the simulator's predictions of them)."""
    return ["workload=humaneval", f"workload.num_prompts={a.prompts}", f"workload.max_new_tokens={a.tokens}",
            "real.ignore_eos=true", "real.progress=false", "report.per_run=false"]


def run_dir_name(label: str) -> str:
    return label.replace(" ", "_").replace("=", "")


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        info["cpu_simd"] = sorted(f for f in flags.split() if f.startswith(("avx", "amx", "fma")))
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                                 if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info |= {"gpu": p.name, "gpu_mem_gb": round(p.total_memory / 2**30, 1),
                 "sms": p.multi_processor_count, "cuda": torch.version.cuda}
    return info


def hardware_preset(info: dict) -> str:
    """The hardware preset of the device the check ran on (the simulator's prediction)."""
    name = info.get("gpu", "")
    if "H200" in name:
        return "h200x1"
    if "H100" in name:
        return "h100x1"
    return "local"


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.out = Path(args.out)
        self.work = Path(args.work)
        self.started = time.monotonic()
        self.steps: list[dict] = []
        self.runs: list[dict] = []
        self.skipped: list[str] = []
        self.ar_outputs: list | None = None

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def step(self, name: str, fn, *a, **kw):  # noqa: ANN001, ANN202
        t = time.monotonic()
        try:
            value = fn(*a, **kw)
            self.steps.append({"step": name, "ok": True, "s": round(time.monotonic() - t, 1)})
            return value
        except Exception as e:  # noqa: BLE001 - one failing step must not hide the others
            self.steps.append({"step": name, "ok": False, "s": round(time.monotonic() - t, 1),
                               "error": f"{type(e).__name__}: {e}"[-600:]})
            traceback.print_exc()
            return None

    # ------------------------------------------------------------------------ the real runs
    def pair_overrides(self, target: Path, draft: Path, tshape: gm.Shape, dshape: gm.Shape) -> list[str]:
        out = []
        for role, path, s in (("target", target, tshape), ("draft", draft, dshape)):
            out += [f"pair.{role}.{k}={v}" for k, v in s.preset().items()]
            out.append(f"pair.{role}.path={path}")
        return out + ["pair.name=gpucheck"]

    def cli(self, overrides: list[str], run_dir: Path, timeout_s: float, summary: bool = True) -> dict:
        cmd = [sys.executable, "-m", "testbed", *overrides, f"hydra.run.dir={run_dir}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
            raise RuntimeError(f"exit {proc.returncode}: " + " | ".join(tail))
        return json.loads((run_dir / "summary.json").read_text()) if summary else {}

    def real_run(self, label: str, overrides: list[str], base: list[str], est_s: float) -> None:
        if self.left_s() < est_s:
            self.skipped.append(f"{label}: {self.left_s():.0f} s of the budget left, needs ~{est_s:.0f} s")
            return
        run_dir = self.work / "runs" / run_dir_name(label)
        t = time.monotonic()
        row: dict = {"run": label}
        try:
            summary = self.cli([*base, *overrides], run_dir, timeout_s=max(30.0, self.left_s()))
            import pandas as pd

            # by request: under load requests finish out of order
            outs = pd.read_parquet(run_dir / "requests.parquet").sort_values("request_id")["output_ids"].map(list).tolist()
            if label == "ar":
                self.ar_outputs = outs
            row |= {"tokens_per_s": summary.get("tokens_per_s"), "speedup": summary.get("speedup"),
                    "alpha": summary.get("alpha"), "mean_accepted_len": summary.get("mean_accepted_len"),
                    "equal_ar": outs == self.ar_outputs if self.ar_outputs is not None else None,
                    "telemetry": (run_dir / "telemetry.parquet").is_file(),
                    "gpu_telemetry": _has_gpu_columns(run_dir / "telemetry.parquet"),
                    "run_dir": str(run_dir.relative_to(self.work)), **_round_times(run_dir)}
            row |= self.predict(label, overrides, run_dir, summary)
        except Exception as e:  # noqa: BLE001 - reported, the next run goes on
            row["error"] = f"{type(e).__name__}: {e}"[-700:]
        row["s"] = round(time.monotonic() - t, 1)
        self.runs.append(row)
        print(f"  {label}: {json.dumps({k: v for k, v in row.items() if k != 'run_dir'})}", flush=True)

    def predict(self, label: str, overrides: list[str], run_dir: Path, measured: dict) -> dict:
        """The simulator's prediction of this run from its own trace (acceptance=trace)."""
        if label.startswith("ar") or self.left_s() < 20 or (self.args.tiny and label != TINY_RUNS[0]):
            return {}
        out = {}
        models = [o for o in self.base_pair if o.startswith("pair.")]
        common = ["backend=sim", f"hardware={self.preset}", "acceptance=trace",
                  f"acceptance.trace_path={run_dir}", *models,
                  *(o for o in overrides if not o.startswith("real.")),
                  *(o for o in self.base_workload if not o.startswith("real."))]
        if "placement.nodes=2" not in overrides:
            common += ["placement.target_gpus=1", "placement.draft_gpus=1"]
        for model, extra in (("roofline", ["sim.cost_model=roofline"]),
                             ("profile", ["sim.cost_model=profile", f"sim.profile_path={self.profile}"])):
            if model == "profile" and (not self.profile or "real.cuda_graphs=false" in overrides):
                continue  # (the profile times graph replays: an eager run is another machine)
            try:
                sim = self.cli([*common, *extra], run_dir.parent / f"{run_dir.name}_sim_{model}", timeout_s=120)
                pred = sim.get("tokens_per_s")
                out[f"sim_{model}_tokens_per_s"] = pred
                if pred and measured.get("tokens_per_s"):
                    out[f"sim_{model}_error_pct"] = round(100 * (pred / measured["tokens_per_s"] - 1), 1)
            except Exception as e:  # noqa: BLE001
                out[f"sim_{model}_error"] = f"{type(e).__name__}: {e}"[-300:]
        return out

    # ------------------------------------------------------------------------------ main
    def run(self) -> dict:
        a = self.args
        info = self.step("machine", machine, self.device) or {}
        self.preset = hardware_preset(info) if self.device.type == "cuda" else "local"
        peaks = self.peaks = self.step("peaks", gm.machine_peaks, self.device, tiny=a.tiny) or {}
        tshape, dshape = (gm.TARGET_TINY, gm.DRAFT_TINY) if a.tiny else (gm.TARGET_1B, gm.DRAFT_60M)
        tmix, dmix = (0.7, 0.5) if a.tiny else (0.8, 0.5)
        gen_dev = "cuda" if self.device.type == "cuda" else "cpu"
        target = self.step("write target", gm.write_checkpoint, self.work / "target", tshape, mix=tmix, seed=1, device=gen_dev)
        draft = self.step("write draft", gm.write_checkpoint, self.work / "draft", dshape, mix=dmix, seed=2, device=gen_dev)
        forwards = []
        if target is not None and peaks and "forwards" not in a.skip:
            forwards = self.step("k-token forwards", self.forwards, target) or []
        self.profile = ""
        if target is not None and draft is not None:
            self.base_pair = self.pair_overrides(target, draft, tshape, dshape)
            self.base_workload = workload_overrides(a)
            # fp32: a GPU's bf16 GEMMs round differently for 1 and k rows (cuBLAS picks kernels by
            # shape), so greedy bf16 outputs can part at near-ties; the k-token table is bf16
            base = ["backend=real", f"real.device={a.device}", "real.dtype=fp32", *self.base_pair,
                    *self.base_workload, "placement.target_gpus=1", "placement.draft_gpus=1"]
            est = 15 if a.tiny else 25
            self.real_run("ar", ["schedule=ar", "real.baseline=false"], base, est)
            for label, overrides in RUNS:
                if (a.tiny and label not in TINY_RUNS) or (a.runs and label not in a.runs):
                    continue
                if label == "+calibrate":
                    continue  # after the device tests: the longest step, the first the budget drops
                if label.startswith("decentralized"):
                    base_dec = [o for o in base if not o.startswith("placement.draft_gpus")]
                    self.real_run(label, overrides, base_dec, est * 1.5)
                else:
                    self.real_run(label, overrides, base, est)
            if not a.tiny and "device-tests" not in a.skip:
                self.step("device tests", self.device_tests)
            if not a.tiny and (not a.runs or "+calibrate" in a.runs):
                self.step("calibrate", self.calibrate, base)
            if self.profile:  # the chain and tree runs predicted again, now from the measured tables
                for row in self.runs:
                    if row["run"].startswith(("sync", "serial")) and "error" not in row and self.left_s() > 30:
                        overrides = dict(RUNS)[row["run"]]
                        row |= self.predict(row["run"], overrides, self.work / row["run_dir"], row)
        return self.summary(info, peaks, forwards)

    def device_tests(self) -> None:
        """The tests that only a machine like this one runs in full: the CUDA-graph replay
        against eager, and the native CPU kernels on this host's SIMD (AVX-512/AMX hosts)."""
        if self.left_s() < 30:
            self.skipped.append(f"device tests: {self.left_s():.0f} s of the budget left")
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/real/test_cuda_graphs.py", "tests/specbed_kernels/test_native_kernels.py"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=max(30.0, self.left_s()))
        self.device_tests_result = (proc.stdout.strip().splitlines() or [""])[-1]
        if proc.returncode != 0:
            raise RuntimeError(f"pytest exit {proc.returncode}: {self.device_tests_result}")

    def forwards(self, target: Path) -> list[dict]:
        from real.model.weights import load_model

        model, _ = load_model(target, dtype=torch.bfloat16, device=self.device, max_seq=64)
        ks = list(range(1, 17)) if not self.args.tiny else [1, 2, 4, 8, 16]
        rows = gm.forward_times(model, context=self.args.context, ks=ks, peaks=self.peaks,
                                repeats=20 if self.device.type == "cuda" else 3)
        del model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return rows

    def calibrate(self, base: list[str]) -> None:
        if self.left_s() < (30 if self.args.tiny else 160):  # ~150 s for the 1 B pair on an H200
            self.skipped.append(f"+calibrate: {self.left_s():.0f} s of the budget left")
            return
        run_dir = self.work / "runs" / "calibrate"
        profile = self.work / "profile.json"
        self.cli([*base, "schedule=sync", "+calibrate=true", f"sim.profile_path={profile}"], run_dir,
                 timeout_s=max(60.0, self.left_s() - 10), summary=False)
        self.profile = str(profile) if profile.is_file() else ""
        if self.profile:  # beside the summary: the tables the profile predictions used
            shutil.copyfile(profile, self.out / "gpu_check_profile.json")

    def summary(self, info: dict, peaks: dict, forwards: list[dict]) -> dict:
        return {"machine": info, "peaks": peaks, "device_tests": getattr(self, "device_tests_result", None), "hardware_preset": self.preset, "tiny": self.args.tiny,
                "prompts": self.args.prompts, "tokens": self.args.tokens,
                "forwards": forwards, "runs": self.runs, "steps": self.steps, "skipped": self.skipped,
                "all_equal_ar": all(r.get("equal_ar") for r in self.runs if r["run"] != "ar")
                and bool(self.runs) and all("error" not in r for r in self.runs),
                "elapsed_s": round(time.monotonic() - self.started, 1)}


def _round_times(run_dir: Path) -> dict:
    """Mean milliseconds per round: drafting, the target's forward, and the whole round (the
    rest is the host's work between forwards)."""
    try:
        import pandas as pd

        r = pd.read_parquet(run_dir / "rounds.parquet")
        return {"round_ms": round(1e3 * float((r.end_s - r.start_s).mean()), 3),
                "draft_ms": round(1e3 * float(r.draft_s.mean()), 3),
                "target_ms": round(1e3 * float(r.target_s.mean()), 3)}
    except Exception:  # noqa: BLE001 - a schedule without per-round times
        return {}


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _round_cell(r: dict) -> str:
    return "-" if "round_ms" not in r else f"{r['round_ms']} ({r['draft_ms']} / {r['target_ms']})"


def _has_gpu_columns(path: Path) -> bool:
    try:
        import pandas as pd

        return "gpu_util_percent" in pd.read_parquet(path).columns
    except Exception:  # noqa: BLE001
        return False


def markdown(s: dict) -> str:
    m = s["machine"]
    lines = [f"# GPU check: {m.get('gpu', m.get('cpu_model', m.get('cpu')))}", "",
             f"torch {m.get('torch')}, CUDA {m.get('cuda', '-')}, {m.get('cores')} cores "
             f"({m.get('cpu_model', '')}; {' '.join(m.get('cpu_simd', []))}).",
             f"Measured: {s['peaks'].get('bandwidth_GBps')} GB/s (copy, read + written), "
             f"{s['peaks'].get('bf16_tflops')} bf16 TFLOP/s. Simulator preset: `{s['hardware_preset']}`. "
             f"Elapsed {s['elapsed_s']} s.", "", "## k-token forwards of the target", "",
             "| k | eager ms | graph ms | roofline ms | eager share | graph share |", "|---|---|---|---|---|---|"]
    for r in s["forwards"]:
        lines.append(f"| {r['k']} | {r['eager_ms']} | {r.get('graph_ms', '-')} | {r['roofline_ms']} | "
                     f"{r['eager_share']} | {r.get('graph_share', '-')} |")
    lines += ["", "## Runs (temperature 0)", "",
              "| run | tokens/s | speedup | α | = ar | GPU telemetry | round ms (draft / target) "
              "| sim roofline tok/s (err %) | sim profile tok/s (err %) | error |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["runs"]:
        def pred(kind: str, r: dict = r) -> str:
            v = r.get(f"sim_{kind}_tokens_per_s")
            return "-" if v is None else f"{v:.1f} ({r.get(f'sim_{kind}_error_pct')})"
        err = r.get("error") or r.get("sim_roofline_error") or r.get("sim_profile_error") or ""
        tps = r.get("tokens_per_s")
        lines.append(f"| {r['run']} | {'-' if tps is None else f'{tps:.1f}'} | {_num(r.get('speedup'))} | "
                     f"{_num(r.get('alpha'))} | {r.get('equal_ar', '-')} | "
                     f"{r.get('gpu_telemetry', '-')} | {_round_cell(r)} | {pred('roofline')} | {pred('profile')} | {err[:160]} |")
    lines += ["", "## Steps", ""] + [f"- {x['step']}: {'ok' if x['ok'] else 'FAILED ' + x.get('error', '')} ({x['s']} s)"
                                     for x in s["steps"]]
    if s["skipped"]:
        lines += ["", "## Skipped (budget)", ""] + [f"- {x}" for x in s["skipped"]]
    return "\n".join(lines) + "\n"


def archive_runs(runs: Path, archive: Path, max_file_bytes: int = 4 << 20) -> None:
    """The runs' directories (summaries, requests, rounds, timelines, experiments) in one file
    beside the summary: the GPU machine is gone after the check, and the simulator's predictions
    of its runs can be made again from these traces anywhere (acceptance.trace_path)."""
    import tarfile

    if not runs.is_dir():
        return

    def small(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if ".hydra" in Path(info.name).parts or info.size > max_file_bytes else info

    with tarfile.open(archive, "w:gz") as tar:
        tar.add(runs, arcname="runs", filter=small)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the dry run)")
    p.add_argument("--tiny", action="store_true", help="tiny models (the dry run)")
    p.add_argument("--budget-s", type=float, default=520.0, help="skip what would not fit after this")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--context", type=int, default=None, help="KV slots before the timed forwards")
    p.add_argument("--runs", nargs="+", default=None, metavar="LABEL",
                   help="only these runs after ar (labels as in the summary, '+calibrate' included)")
    p.add_argument("--skip", nargs="+", default=[], choices=["forwards", "device-tests"],
                   help="leave out the k-token forwards or the device tests")
    p.add_argument("--out", default=os.environ.get("OUT") or "reports/gpu_check")
    p.add_argument("--work", default=None, help="checkpoints and run directories (default: OUT/../work)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.runs or []) - {label for label, _ in RUNS})
    if unknown:
        print(f"gpu_check: no run named {', '.join(unknown)}; the runs are: {', '.join(label for label, _ in RUNS)}")
        return 2
    args.prompts = args.prompts or (2 if args.tiny else 4)
    args.tokens = args.tokens or (12 if args.tiny else 64)
    args.context = args.context or (32 if args.tiny else 512)
    args.work = args.work or ("/tmp/specbed-gpu-check" if os.environ.get("OUT") else str(Path(args.out) / "work"))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device; use --device cpu --tiny for the dry run")
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    s = Check(args).run()
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(s, indent=1, default=str))
    archive_runs(Path(args.work) / "runs", Path(args.out) / "gpu_check_runs.tar.gz")
    md = markdown(s)
    (Path(args.out) / "gpu_check.md").write_text(md)
    print(md)
    return 0 if s["all_equal_ar"] and all(x["ok"] for x in s["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
