"""The simulator's predictions of a GPU check's runs, made again on any machine after the GPU is
gone: from the check's output folder (``gpu_check.json``, ``gpu_check_runs.tar.gz`` and, where
``+calibrate`` ran, ``gpu_check_profile.json``), or with another profile (``--profile``).

    python scripts/gpu_check_predict.py docs/gpu/h200 [--profile P] [--out DIR]

Each speculative run is predicted from its own trace as the check predicts it (acceptance=trace,
the check's hardware preset, the roofline and the profile cost models); writes
``gpu_check_predicted.{json,md}`` to ``--out`` (default: the folder) and prints the table. The
check leaves these out when its time budget runs short (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts import gpu_check as gc  # noqa: E402
from scripts import gpu_check_models as gm  # noqa: E402


def predictions(folder: Path, profile: Path | None, work: Path) -> dict:
    """The check's summary with every run's predictions made again (``sim_*`` fields)."""
    summary = json.loads((folder / "gpu_check.json").read_text())
    with tarfile.open(folder / "gpu_check_runs.tar.gz") as tar:
        tar.extractall(work, filter="data")
    tiny = bool(summary.get("tiny"))
    args = argparse.Namespace(tiny=tiny, budget_s=float("inf"), device="cpu", out=str(work), work=str(work),
                              skip=[], runs=None, prompts=summary.get("prompts") or (2 if tiny else 4),
                              tokens=summary.get("tokens") or (12 if tiny else 64))
    check = gc.Check(args)
    check.preset = summary["hardware_preset"]
    shapes = (gm.TARGET_TINY, gm.DRAFT_TINY) if tiny else (gm.TARGET_1B, gm.DRAFT_60M)
    # the simulator reads the models' shapes from the overrides, not their weights (gone with the GPU)
    check.base_pair = check.pair_overrides(work / "target", work / "draft", *shapes)
    check.base_workload = gc.workload_overrides(args)
    check.profile = str(profile) if profile is not None else ""
    overrides = dict(gc.RUNS)
    rows = []
    for row in summary["runs"]:
        row = {k: v for k, v in row.items() if not k.startswith("sim_")}
        run_dir = work / "runs" / gc.run_dir_name(row["run"])
        if row["run"] in overrides and "error" not in row and (run_dir / "summary.json").is_file():
            row |= check.predict(row["run"], overrides[row["run"]], run_dir, row)
        rows.append(row)
    return {**summary, "runs": rows, "profile": check.profile or None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a GPU check's output folder")
    p.add_argument("--profile", type=Path, default=None,
                   help="the profile to predict with (default: the folder's gpu_check_profile.json, if any)")
    p.add_argument("--out", type=Path, default=None, help="where to write (default: the folder)")
    a = p.parse_args(argv)
    missing = [n for n in ("gpu_check.json", "gpu_check_runs.tar.gz") if not (a.folder / n).is_file()]
    if missing:
        print(f"gpu_check_predict: {a.folder} lacks {', '.join(missing)}: give the folder a GPU check wrote")
        return 2
    profile = a.profile or (a.folder / "gpu_check_profile.json")
    if a.profile is not None and not a.profile.is_file():
        print(f"gpu_check_predict: no profile at {a.profile}")
        return 2
    out = a.out or a.folder
    with tempfile.TemporaryDirectory() as tmp:
        s = predictions(a.folder, profile if profile.is_file() else None, Path(tmp))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check_predicted.json").write_text(json.dumps(s, indent=1, default=str))
    md = gc.markdown(s)
    (out / "gpu_check_predicted.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
