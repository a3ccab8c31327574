"""Every command the README shows is run: the command lines of README.md's fenced code blocks
(those starting with ``python -m``, ``.venv/bin/python``, ``torchrun`` or ``make``), each in a
smoke configuration, asserting exit code 0, the files the README promises for that kind of
command, and that no process it started is left.

How a command is shrunk lives in one table, ``SMOKE``, keyed by the command exactly as the
README writes it (its trailing ``# comment`` removed): the overrides appended to it, what it must
write, and whether it is ``slow`` (over ~20 s even shrunk, or a path the default run takes
elsewhere; run with ``-m slow``); a slow command marked ``precheck`` still passes the CLI's pre-run
check in the default run. A README command without an entry fails ``test_readme_command`` with a
line saying to add one, so a new or changed command cannot go untested; an entry whose command
left the README fails ``test_every_smoke_entry_is_a_readme_command``. Placeholders: ``DIR`` in
``hydra.run.dir=DIR`` / ``hydra.sweep.dir=DIR`` is a temporary directory, ``DIR...`` of
``testbed.report`` (and of its ``chrome_trace``) a run directory written first by the shrunk default command. Every output
goes to a temporary directory; the one command that writes into the checkout (``+calibrate``:
reports/profiles/local.json) has that file restored afterwards.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.helpers.processes import live_descendants

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PREFIXES = ("python -m", ".venv/bin/python", "torchrun", "make")

# Commands of the fenced blocks that are not run here, and why. The install lines
# (`python3 -m venv .venv`, `.venv/bin/pip install ...`) do not start with the prefixes above:
# they made the environment this test runs in, and re-running them would rewrite that venv
# (and needs the package index).
SKIPPED = {
    # the default suite itself: running it from inside the suite would recurse
    "make test": "runs this test suite (recursion)",
    ".venv/bin/python -m pytest -q -n 2": "= make test: runs this test suite (recursion)",
    # the whole suite with the slow tests, and the benchmarks (benchmarks/run_all.py, tens of
    # minutes, measured by their own scripts); named in the README's prose, skipped if fenced
    "make test-all": "runs this test suite and its slow tests (recursion)",
    "make bench": "the benchmarks: minutes of measurement, not a smoke check",
}

# what the README's file table promises every run directory, and a real run besides
RUN_FILES = ("summary.json", "rounds.parquet", "requests.parquet", "timeline.parquet",
             "experiment.yaml", "run_info.json", "experiment_hash")
REAL_FILES = (*RUN_FILES, "telemetry.parquet")
# a sweep directory: its results table and one report (each job directory is a run)
SWEEP_FILES = ("results.parquet", "results.csv", "report.md", "report.html")

SIM = ("workload.num_prompts=1", "workload.max_new_tokens=8")
REAL = ("workload.num_prompts=1", "workload.max_new_tokens=4", "real.progress=false")
# simulated sweeps: one or two grid points (the command line wins over the sweep's grid)
WAN = ("placement.nodes=2", "network.latency_ms=5", "schedule.tau=0.0,0.2", *SIM)
# real sweeps: one grid point, its roles (calibrate/measure/predict) back to back; the latency
# profile they predict from is measured once, into a temporary file (``profile`` fixture)
REAL_SWEEP = ("workload.num_prompts=2", "workload.max_new_tokens=4", "sim.profile_path={profile}")


@dataclass(frozen=True)
class Smoke:
    """``args``: appended to the command ({tmp}, {profile} substituted); ``kind``: what it must
    write — run (a run directory), real (+ telemetry), sweep (a sweep directory and its job
    runs), report, trace (chrome_trace: trace.json in the run), stdout, calibrate, train, eval; ``files``: more files of its output
    directory; ``stdout``: text its output must contain; ``slow``: over ~20 s shrunk, or a path
    the default run takes elsewhere; ``precheck``: (slow ones) its pre-run check runs by default."""

    kind: str
    args: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    stdout: str = ""
    slow: bool = False
    timeout: int = 300
    precheck: bool = False


# The default run starts one command of each kind the README shows (a simulated run through
# make and directly, a real run, a sweep run twice into its directory, a report, --help,
# sim.cost.latency); the simulator's other commands are slow-marked (each 2-9 s, ~40 s together):
# their schedules and sweeps are run by the default suite elsewhere (test_sim_determinism,
# test_decentralized_sim, test_sim_sweeps; the joblib launcher end to end by test_worker_pool),
# and their command lines pass the CLI's pre-run check here by default.
SMOKE: dict[str, Smoke] = {
    "make run": Smoke("run", SIM),
    # the same argv as `python -m testbed` once the interpreter is this test's
    ".venv/bin/python -m testbed": Smoke("run", SIM, slow=True, precheck=True),
    "python -m testbed": Smoke("run", SIM, files=("report.md", "report.html")),
    "python -m testbed schedule=ar": Smoke("run", SIM),
    "python -m testbed schedule.gamma=7 acceptance.alpha=0.7": Smoke("run", SIM),
    "python -m testbed schedule=async": Smoke("run", SIM, slow=True, precheck=True),
    # real runs: ~16-27 s each even shrunk (imports, weights, probe forwards, the ar baseline);
    # the plain one stays in the default suite, the others are slow
    "python -m testbed backend=real schedule=async": Smoke("real", REAL, slow=True),
    "python -m testbed schedule=decentralized hardware=a800_nodes placement.nodes=4 network=wan":
        Smoke("run", SIM, slow=True, precheck=True),
    "python -m testbed backend=real": Smoke("real", REAL, files=("baseline_requests.parquet",)),
    "python -m testbed backend=real pair=smollm2_135m+ngram3 workload=mtbench sampling.temperature=1":
        Smoke("real", REAL, slow=True),
    "python -m testbed backend=real schedule.tree=true": Smoke("real", REAL, slow=True),
    # two clients, three prompts: a batch of two, then one joining as another leaves
    "python -m testbed backend=real schedule=sync workload.concurrency=4 workload.num_prompts=8 workload.max_new_tokens=32":
        Smoke("real", ("workload.concurrency=2", "workload.num_prompts=3", "workload.max_new_tokens=6",
                       "real.progress=false"), stdout="under load: 2 clients", slow=True),
    "python -m testbed backend=real schedule.tree=true placement.target_gpus=2 placement.draft_gpus=2":
        Smoke("real", REAL, slow=True),
    "torchrun --standalone --nproc-per-node 2 -m testbed backend=real placement.target_gpus=2 "
    "placement.draft_gpus=2 hydra.run.dir=DIR": Smoke("real", REAL, slow=True, timeout=600),
    # not shrinkable from the command line (its grid is real.calibrate.profile.Grid): the full ~5 minutes
    "python -m testbed backend=real +calibrate": Smoke("calibrate", files=("profile.json",), slow=True, timeout=1800),
    "python -m testbed +sweep=gamma": Smoke(
        "sweep", ("schedule.gamma=1,4", "acceptance.alpha=0.7", *SIM), slow=True, precheck=True),
    "python -m testbed +sweep=gpu_split": Smoke(
        "sweep", ("pair=llama3_70b+llama3_2_3b", "+split=t5,sync", *SIM), slow=True, precheck=True),
    "python -m testbed +sweep=gpu_split backend=real": Smoke(
        # two splits: the report compares splits (gpu_split_validation.csv needs more than one)
        "sweep", ("+split=sync,ar", *REAL_SWEEP), files=("gpu_split_validation.csv",), slow=True, timeout=1800),
    # two loads and two γ: the report's load section needs more than one load
    "python -m testbed +sweep=load": Smoke(
        "sweep", ("workload.rate=1,64", "schedule.gamma=2", "workload.num_prompts=8", "workload.max_new_tokens=32"),
        stdout="sweep report"),
    # (the default run has this sweep, run twice into one directory, below)
    "python -m testbed +sweep=wan": Smoke("sweep", WAN, slow=True, precheck=True),
    "python -m testbed +sweep=validate": Smoke(
        "sweep", ("hydra.sweeper.only=[base]", "pair=smollm2_135m+ngram3", "workload=humaneval",
                  "sampling.temperature=0.0", "schedule.gamma=2", *REAL_SWEEP),
        files=("validation.csv",), slow=True, timeout=1800),
    # two policies: the report's Table 1 compares policies (lookahead.csv needs more than one)
    "python -m testbed +sweep=lookahead": Smoke(
        "sweep", ("hydra.sweeper.only=[base]", "lookahead=static,heuristic", "pair=smollm2_135m+ngram3",
                  "workload=humaneval", "sampling.temperature=0.0", "schedule.gamma=2", *REAL_SWEEP),
        files=("lookahead.csv",), slow=True, timeout=1800),
    "python -m testbed.report DIR...": Smoke("report"),
    "python -m testbed.report.chrome_trace DIR...": Smoke("trace"),
    "python -m testbed --help": Smoke("stdout", stdout="schedule.gamma"),
    "python -m testbed +sweep=wan hydra/launcher=joblib": Smoke("sweep", WAN, slow=True, precheck=True),
    # run twice into the same DIR: the second run skips both finished jobs
    "python -m testbed +sweep=wan hydra.sweep.dir=DIR": Smoke("sweep", WAN, stdout="2 skipped"),
    "python -m sim.cost.latency model=llama3_70b hardware=h800x8 tp=4 tokens=8 context=512 quant=int4_awq":
        Smoke("stdout", stdout="total"),
    # a few teacher batches of 4 tokens and 3 optimizer steps of the real recipe, into {tmp}
    "python -m real.train.draft": Smoke(
        "train", ("steps=3", "train.warmup=1", "train.batch_rows=2", "train.seq_len=32",
                  "data.max_prompts_per_workload=1", "data.stdlib_functions=1", "data.max_new_tokens=4",
                  "data.max_new_tokens_sampled=0", "data.raw_tokens=0", "data.gen_batch=4",
                  "out={tmp}/draft", "work_dir={tmp}/work", "hydra.run.dir={tmp}/hydra"),
        files=("config.json", "model.safetensors"), slow=True, timeout=900),
    "python -m real.train.eval_draft": Smoke(
        "eval", ("workloads=[humaneval]", "num_prompts=1", "max_new_tokens=4", "timing.reps=2",
                 "out_dir={tmp}/eval", "hydra.run.dir={tmp}/hydra"), slow=True, timeout=900),
}


def readme_commands() -> list[str]:
    """The command lines of README.md's fenced code blocks, their trailing comments removed."""
    out, fenced = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        cmd = re.split(r"\s+#", line.strip(), maxsplit=1)[0].strip()
        if fenced and cmd.startswith(PREFIXES) and cmd not in out:
            out.append(cmd)
    return out


def _params() -> list:  # type: ignore[type-arg]
    out = []
    for cmd in readme_commands():
        if cmd in SKIPPED:
            continue
        smoke = SMOKE.get(cmd)
        marks = [pytest.mark.slow] if smoke and smoke.slow else []
        out.append(pytest.param(cmd, marks=marks, id=cmd))
    return out


def _executable(word: str) -> str:
    """The README's `python`, `.venv/bin/python` and `torchrun`: this test's interpreter and
    the torchrun beside it."""
    if word in ("python", ".venv/bin/python"):
        return sys.executable
    if word == "torchrun":
        return shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    return word


def _argv(cmd: str, smoke: Smoke, out: Path, subs: dict[str, str]) -> list[str]:
    """The README command with its placeholders filled and the smoke overrides appended; a run
    or sweep without an output directory of its own gets ``out``."""
    words = [w.replace("=DIR", f"={out}") for w in shlex.split(cmd)]
    args = [a.format(**subs) for a in smoke.args]
    if smoke.kind in ("run", "real", "calibrate") and not any(w.startswith("hydra.run.dir=") for w in words):
        args.append(f"hydra.run.dir={out}")
    if smoke.kind == "sweep" and not any(w.startswith("hydra.sweep.dir=") for w in words):
        args.append(f"hydra.sweep.dir={out}")
    if words[0] == "make":
        # STAMP= skips make's set-up step (a venv and `pip install -e`, the install lines
        # skipped above): with it, make would reinstall the project into this interpreter's venv
        assert words[1:] == ["run"], cmd
        return ["make", "-s", "-C", str(ROOT), "run", "STAMP=", f"PY={sys.executable}",
                "ARGS=" + " ".join(shlex.quote(a) for a in args)]
    words[0] = _executable(words[0])
    if "DIR..." in words:
        words[words.index("DIR...")] = subs["run"]
    return [*words, *args]


def _run(argv: list[str], timeout: int) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """``argv`` from the repository root, as the README runs it; past ``timeout`` its whole
    process group is killed (a torchrun's ranks, a sweep's workers), not only its first process
    (and on any other interruption of the test)."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {shlex.join(argv)}")
    except BaseException:  # Ctrl-C: end what it started too
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _ok(p: subprocess.CompletedProcess, argv: list[str]) -> None:  # type: ignore[type-arg]
    assert p.returncode == 0, (f"exit code {p.returncode}: {shlex.join(argv)}\n"
                               f"{(p.stdout + p.stderr)[-3000:]}")


def _missing(d: Path, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not (d / n).exists()]


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A latency-profile path for the real sweeps, measured by the first one's pre-run check
    (minutes) and reused by the others (the checkout's own profile is left alone)."""
    return str(tmp_path_factory.mktemp("profile") / "local.json")


@pytest.mark.parametrize("cmd", _params())
def test_readme_command(cmd: str, tmp_path: Path, profile: str) -> None:
    smoke = SMOKE.get(cmd)
    if smoke is None:
        pytest.fail(f"the README command `{cmd}` has no entry in SMOKE of tests/test_readme_commands.py: "
                    "add one (the overrides that shrink it, what it must write, slow or not), or "
                    "to SKIPPED with the reason it cannot run here")
    out = tmp_path / "out"
    subs = {"tmp": str(tmp_path), "profile": profile, "run": str(tmp_path / "run")}
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    if "DIR..." in cmd:  # the run the report is rebuilt from
        first = [sys.executable, "-m", "testbed", *SIM, "report.per_run=false", f"hydra.run.dir={subs['run']}"]
        _ok(_run(first, 120), first)
    saved = None
    if smoke.kind == "calibrate":  # it writes the checkout's profile: keep the one found there
        from testbed.paths import default_profile_path

        prof = default_profile_path("local")
        saved = prof.read_bytes() if prof.exists() else None
        stamp = prof.stat().st_mtime_ns if prof.exists() else None
        made = [d for d in (prof.parent.parent, prof.parent) if not d.exists()]
    argv = _argv(cmd, smoke, out, subs)
    try:
        p = _run(argv, smoke.timeout)
        _ok(p, argv)
        if "hydra.sweep.dir=DIR" in cmd:  # re-run into the same DIR
            p = _run(argv, smoke.timeout)
            _ok(p, argv)
        if smoke.kind == "calibrate":
            assert prof.exists() and prof.stat().st_mtime_ns != stamp, f"{prof} not written"
    finally:
        if smoke.kind == "calibrate":
            if saved is None:
                prof.unlink(missing_ok=True)
                for d in reversed(made):  # and the folders it made, when empty
                    if d.exists() and not any(d.iterdir()):
                        d.rmdir()
            else:
                prof.write_bytes(saved)
    assert live_descendants(before) == [], f"processes left by {cmd}"
    text = p.stdout + p.stderr
    assert smoke.stdout in text, f"{cmd}: no {smoke.stdout!r} in its output:\n{text[-2000:]}"

    if smoke.kind == "run":
        assert _missing(out, RUN_FILES + smoke.files) == [], cmd
    elif smoke.kind == "real":
        assert _missing(out, REAL_FILES + smoke.files) == [], cmd
    elif smoke.kind == "sweep":
        assert _missing(out, SWEEP_FILES + smoke.files) == [], cmd
        jobs = [d for d in out.iterdir() if d.is_dir() and d.name.isdigit()]
        assert jobs and all(_missing(d, RUN_FILES) == [] for d in jobs), (cmd, sorted(out.iterdir()))
    elif smoke.kind == "calibrate":  # the run directory keeps a copy of the profile
        assert _missing(out, smoke.files) == [], cmd
    elif smoke.kind == "report":
        assert _missing(Path(subs["run"]), ("report.md", "report.html")) == [], cmd
    elif smoke.kind == "trace":
        assert _missing(Path(subs["run"]), ("trace.json",)) == [], cmd
    elif smoke.kind == "train":
        assert _missing(tmp_path / "draft", smoke.files) == [], cmd
    elif smoke.kind == "eval":
        assert list((tmp_path / "eval").glob("*/eval.json")), cmd


@pytest.mark.parametrize("cmd", [cmd for cmd, smoke in SMOKE.items() if smoke.precheck])
def test_slow_simulator_command_passes_the_pre_run_check(cmd: str, tmp_path: Path) -> None:
    """What the default run keeps of a slow-marked simulator command: its command line, with its
    smoke overrides, passes the pre-run check its run starts with (testbed/preflight.py: every
    key, value and preset of every job; ~1 s), so a renamed preset or setting fails by default."""
    from testbed.app.preflight import normalize_args, preflight

    assert SMOKE[cmd].slow, f"{cmd}: precheck is for slow-marked commands (the others run by default)"

    # the arguments test_readme_command gives the command (its output directory under tmp_path)
    argv = _argv(cmd, SMOKE[cmd], tmp_path / "out", {"tmp": str(tmp_path), "profile": "", "run": ""})
    assert argv[1:3] == ["-m", "testbed"], argv
    jobs = preflight(normalize_args(argv[3:]))
    assert jobs >= (2 if SMOKE[cmd].kind == "sweep" else 1), cmd


def test_the_readme_shows_commands_and_every_smoke_entry_is_one() -> None:
    """The parser finds the README's commands, and no SMOKE/SKIPPED entry outlived its command
    (an entry left behind by an edited command would hide that the new one has none)."""
    cmds = readme_commands()
    assert "python -m testbed" in cmds and len(cmds) > 20
    stale = [c for c in SMOKE if c not in cmds]
    assert stale == [], f"SMOKE entries for commands the README no longer shows: {stale}"
