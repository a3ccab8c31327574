"""testbed/report/chrome_trace.py: a run's timeline as Chrome trace JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from sim.runtime.engine import run
from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.report.chrome_trace import DEVICES_PID, LINKS_PID, main
from testbed.results import write_run
from tests.conftest import compose_exp


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exp = compose_exp("schedule=async", "workload.num_prompts=2", "workload.max_new_tokens=24")
    path = tmp_path_factory.mktemp("runs") / "async"
    write_run(path, exp, run(exp))
    return path


def events(path: Path) -> list[dict]:
    trace = json.loads(path.read_text())
    assert set(trace) >= {"traceEvents"}
    return trace["traceEvents"]


def test_every_span_is_a_complete_event_on_its_resources_track(async_run: Path) -> None:
    assert main([str(async_run)]) == 0
    evs = events(async_run / "trace.json")
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    timeline = pd.read_parquet(async_run / "timeline.parquet")
    spans = [e for e in evs if e["ph"] == "X"]
    assert len(spans) == len(timeline) > 0
    got = sorted((tracks[(e["pid"], e["tid"])], e["name"], round(e["ts"]), round(e["dur"])) for e in spans)
    want = sorted((r.resource, r.kind, round(r.start_s * 1e6), round((r.end_s - r.start_s) * 1e6))
                  for r in timeline.itertuples())
    assert got == want
    assert {tracks[k] for k in tracks if k[0] == LINKS_PID} == {r for r in timeline.resource if r.startswith("link")}
    assert {tracks[k] for k in tracks if k[0] == DEVICES_PID} == {"target", "draft"}
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in spans)


def test_a_verification_carries_its_rounds_counts(async_run: Path) -> None:
    assert main([str(async_run)]) == 0
    rounds = pd.read_parquet(async_run / "rounds.parquet").set_index(["request_id", "round"])
    verifies = [e for e in events(async_run / "trace.json") if e["ph"] == "X" and e["name"] == "verify"]
    assert verifies
    for e in verifies:
        row = rounds.loc[(e["args"]["request"], e["args"]["round"])]
        assert (e["args"]["accepted"], e["args"]["emitted"]) == (row.accepted, row.emitted)


def test_a_real_runs_recorder_exports_the_same_way(tmp_path: Path) -> None:
    # what a real run writes is the same recorder's files: one span per resource, links apart
    rec = RunRecorder()
    rec.span("stage0", "verify", 0.010, 0.030, request_id=0, round_idx=0)
    rec.span("link stage0->stage1", "link", 0.030, 0.050, request_id=0, round_idx=0)
    rec.round(request_id=0, round_idx=0, start_s=0.0, end_s=0.05, drafted=4, checked=3, accepted=2,
              emitted=3, verified_tokens=5)
    rec.request(RequestRecord(request_id=0, prompt_id="p", prompt_len=3, output_ids=[1, 2, 3], generated=3,
                              prefill_s=0.01, decode_s=0.04, rounds=1))
    exp = compose_exp("schedule=decentralized")
    write_run(tmp_path / "r", exp, RunResult(recorder=rec))
    out = tmp_path / "one.json"
    assert main([str(tmp_path / "r"), "--out", str(out)]) == 0
    spans = {e["name"]: e for e in events(out) if e["ph"] == "X"}
    assert spans["verify"]["pid"] == DEVICES_PID and spans["link"]["pid"] == LINKS_PID
    assert spans["link"]["ts"] == pytest.approx(30_000) and spans["link"]["dur"] == pytest.approx(20_000)
    assert spans["verify"]["args"]["accepted"] == 2


def test_bad_input_is_one_line_and_writes_nothing(async_run: Path, tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    assert "no such run" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no complete run" in capsys.readouterr().err
    for name in ("a", "b"):  # --out names one file: two runs are refused
        shutil.copytree(async_run, tmp_path / "two" / name, ignore=shutil.ignore_patterns("trace.json"))
    out = tmp_path / "both.json"
    assert main([str(tmp_path / "two"), "--out", str(out)]) == 2
    assert "2 runs were found" in capsys.readouterr().err
    assert not out.exists() and not list((tmp_path / "two").rglob("trace.json"))


def test_under_load_the_batch_size_is_a_counter_track(tmp_path: Path) -> None:
    exp = compose_exp("schedule=sync", "workload.num_prompts=4", "workload.max_new_tokens=16",
                      "workload.concurrency=3")
    write_run(tmp_path / "r", exp, run(exp))
    assert main([str(tmp_path / "r")]) == 0
    counters = [e for e in events(tmp_path / "r" / "trace.json") if e["ph"] == "C"]
    timeline = pd.read_parquet(tmp_path / "r" / "timeline.parquet")
    batched = timeline[(timeline.resource == "target") & (timeline.batch > 1)]
    assert len(counters) == len(batched) > 0
    assert max(e["args"]["requests"] for e in counters) == 3
