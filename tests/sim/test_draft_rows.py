"""The draft's ranked rows: recorded by every tree drafter (testbed.spec.tree_drafter.DraftRowSample),
written beside the run (draft_rows.json), and replayed by the simulator's trace trees
(sim.oracle.tree_tokens.TraceTreeTokens) so that a replayed tree has the recorded draft's shape."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from sim.runtime.engine import run as sim_run
from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.results import write_run
from testbed.spec.tree import DraftTree
from testbed.spec.tree_drafter import DraftRowSample, DraftSource, TreeDrafter
from tests.conftest import compose_exp

VOCAB = 8


class FixedRows(DraftSource):
    """Every node's q is ``row`` shifted by the node's depth (so rows differ in token order only)."""

    def __init__(self, row: list[float]) -> None:
        self.row = torch.tensor(row + [0.0] * (VOCAB - len(row)))

    def history(self) -> list[int]:
        return [3, 5]

    def draft_dists(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        return torch.stack([self.row.roll(tree.depths[n]) for n in nodes])

    def commit(self, tokens: list[int]) -> None:
        pass


def test_rows_are_ranked_below_the_root_and_bounded() -> None:
    rows = DraftRowSample(capacity=5)
    drafter = TreeDrafter(FixedRows([0.1, 0.6, 0.3]), width=2, budget=64, rows=rows)
    drafter.expand()  # the root alone: not recorded
    assert rows.rows == [] and rows.seen == 0
    drafter.expand()  # its two children
    assert rows.rows == [[0.6, 0.3], [0.6, 0.3]] and rows.seen == 2
    for _ in range(10):
        drafter.expand()
    assert rows.seen == 22 and len(rows.rows) == 5  # a sample, not every row
    assert drafter.summary_fields()["draft_rows"] is rows.rows


def test_the_sample_is_uniform_over_the_run() -> None:
    # the reservoir keeps early and late rows alike: offer 2000 rows labelled by their order
    rows = DraftRowSample(capacity=200)
    tree = DraftTree(root_token=0, prefix_len=1)
    tree.expand([0], torch.tensor([[1.0, 0.0]]))  # one node below the root
    for i in range(2000):
        rows.offer(tree, [1], torch.tensor([[i / 2000, 0.0]]), width=1)
    kept = sorted(r[0] for r in rows.rows)
    assert len(kept) == 200
    assert 0.4 < sum(kept) / len(kept) < 0.6  # mean of U[0, 1) over 200: sd 0.02
    assert sum(k < 0.5 for k in kept) / 200 > 0.4


N_TOKENS, WIDTH, BUDGET, DEPTH = 40, 2, 6, 3


def _recorded(seed: int) -> list[list[tuple[int, int]]]:
    """Two requests' rounds as a chain-drafting n-gram records them: deep acceptances (up to
    bs − 1), rejections, and rounds that drafted nothing."""
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        rounds, generated = [], 0
        while generated < N_TOKENS:
            d = rng.choice([0, BUDGET - 1, BUDGET - 1, BUDGET - 1])
            n = min(rng.choice([BUDGET - 1, BUDGET - 1, 4, 1, 0]) if d else 0, N_TOKENS - generated - 1)
            rounds.append((d, n))
            generated += n + 1
        out.append(rounds)
    return out


def _write_async_ngram_run(path: Path, recorded: list[list[tuple[int, int]]], rows: list[list[float]] | None) -> None:
    exp = compose_exp("backend=real", "pair=smollm2_135m+ngram3", "schedule=async",
                      f"schedule.tree_width={WIDTH}", f"schedule.tree_budget={BUDGET}", f"schedule.gamma={DEPTH}",
                      "workload.split=trace", "workload=humaneval", f"workload.max_new_tokens={N_TOKENS}")
    rec = RunRecorder()
    for rid, rounds in enumerate(recorded):
        t = 0.0
        for i, (d, n) in enumerate(rounds):
            rec.round(request_id=rid, round_idx=i, start_s=t, end_s=t + 0.01, drafted=d, checked=n + (d > 0),
                      accepted=n, emitted=n + 1, verified_tokens=d + 1, draft_s=0.004, target_s=0.006)
            t += 0.01
        rec.request(RequestRecord(request_id=rid, prompt_id=f"p{rid}", prompt_len=50, output_ids=[],
            generated=N_TOKENS, prefill_s=0.1, decode_s=t, rounds=len(rounds)))
    extra = {"tree_width": WIDTH, "tree_budget": BUDGET, "tree_depth_used": DEPTH}
    write_run(path, exp, RunResult(recorder=rec, extra={**extra, "draft_rows": rows} if rows else extra))


def _replay(trace_dir: Path) -> list[list[int]]:
    exp = compose_exp("pair=smollm2_135m+ngram3", "hardware=local", "sim.cost_model=analytic", "schedule=async",
                      f"schedule.tree_width={WIDTH}", f"schedule.tree_budget={BUDGET}", f"schedule.gamma={DEPTH}",
                      "workload=humaneval", "workload.split=test", "workload.num_prompts=2",
                      f"workload.max_new_tokens={N_TOKENS}", "acceptance=trace", f"acceptance.trace_path={trace_dir}")
    rounds, _, _ = sim_run(exp).recorder.frames()
    return [rounds[rounds["request_id"] == rid]["accepted"].tolist() for rid in range(2)]


def test_the_rows_are_written_beside_the_summary_not_in_it(tmp_path: Path) -> None:
    _write_async_ngram_run(tmp_path, _recorded(1), [[1.0, 0.0], [0.75, 0.25]])
    assert "draft_rows" not in json.loads((tmp_path / "summary.json").read_text())
    assert json.loads((tmp_path / "draft_rows.json").read_text()) == {"draft_rows": [[1.0, 0.0], [0.75, 0.25]]}


def test_a_replay_grown_from_the_recorded_rows_reproduces_deep_rounds(tmp_path: Path) -> None:
    """An n-gram draft's trees are chains (all its mass on one continuation): the replay grown
    from its rows accepts exactly what every recorded round accepted, up to bs − 1 deep; grown
    from the geometric row of the trace's match rate its batches are too shallow for that."""
    recorded = _recorded(3)
    want = [[n for _, n in r] for r in recorded]
    assert max(max(w) for w in want) == BUDGET - 1
    _write_async_ngram_run(tmp_path / "with", recorded, [[1.0, 0.0]] * 8)
    assert _replay(tmp_path / "with") == want
    _write_async_ngram_run(tmp_path / "without", recorded, None)
    got = _replay(tmp_path / "without")
    assert sum(map(sum, got)) < sum(map(sum, want))


def test_a_corrupt_rows_file_names_itself_and_the_fix(tmp_path: Path) -> None:
    from testbed.config import ConfigError

    _write_async_ngram_run(tmp_path, _recorded(1), [[1.0, 0.0]])
    (tmp_path / "draft_rows.json").write_text('{"draft_rows": [[1.0, "x"')
    with pytest.raises(ConfigError, match=r"draft_rows.json is not a draft_rows.json.*re-record the run or delete the file"):
        _replay(tmp_path)
