"""Reports a reader can read: tables that render as tables (pipes escaped, no all-empty columns,
human column names), figures with nothing cut off and legends beside their bars, sections only
where they mean something, devices named for what they are, missing files explained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from testbed.recorder import RequestRecord, RunRecorder, RunResult
from testbed.report import build_report, markdown_table, to_html
from testbed.results import write_run
from tests.conftest import compose_exp
from tests.helpers.report_checks import (
    clipped_figures,
    raw_markdown_lines,
    visible_text,
    write_prompts_run,
)


def test_a_header_with_pipes_stays_a_table() -> None:
    df = pd.DataFrame({"family": ["sync"], "observed |transfer| %": [1.5], "tree_shape": [None]})
    md = markdown_table(df)
    page = to_html(md)
    assert "<table>" in page and "observed |transfer| %" in visible_text(page)
    assert not raw_markdown_lines(visible_text(page))
    assert "tree" not in md  # a column empty in every row is left out


def test_validation_tables_use_human_names() -> None:
    df = pd.DataFrame({"metric": ["tokens_per_s"], "median_abs_error_pct": [1.0],
                       "own_acceptance_worst_abs_pct": [2.0], "transfer_pct": [3.0]})
    header = markdown_table(df).splitlines()[0]
    assert "_pct" not in header and "median abs. error %" in header and "transfer %" in header


def test_tree_validation_report_renders_and_says_why_files_are_missing(tmp_path: Path) -> None:
    """`only=[tree]`: the transfer table is a table, and the report says why the chain-only
    timing and rescaled files are not there."""
    runs = tmp_path / "runs"
    write_prompts_run(runs / "0", "real", "trace", "schedule=sync schedule.tree=true", [3, 2, 1])
    write_prompts_run(runs / "1", "real", "test", "schedule=sync schedule.tree=true", [1, 2, 2])
    write_prompts_run(runs / "2", "sim", "test", "schedule=sync schedule.tree=true", [3, 2, 1])
    out = tmp_path / "report"
    md = build_report([runs], out, figures=False).read_text()
    assert "Acceptance transfer between prompt splits" in md
    text = visible_text((out / "report.html").read_text())
    assert not raw_markdown_lines(text), raw_markdown_lines(text)
    assert "observed |transfer| %" in text
    assert not (out / "validation_timing.csv").exists()
    assert "No `validation_timing.csv` and `validation_rescaled.csv`" in md
    assert "chain (`sync`) runs only" in md and "sync_tree" in md.split("runs only")[1].split("\n")[0]


def _sim_runs(tmp: Path, *jobs: tuple[str, ...]) -> Path:
    from sim.runtime.engine import run

    small = ("workload.num_prompts=1", "workload.max_new_tokens=24")
    for i, overrides in enumerate(jobs):
        exp = compose_exp(*overrides, *small)
        write_run(tmp / "runs" / str(i), exp, run(exp))
    return tmp / "runs"


def test_no_gamma_section_for_a_split_sweep_with_ar(tmp_path: Path) -> None:
    """`ar` (γ = 0) beside mixed schedules is no γ sweep: no "throughput against γ", no "Best γ"."""
    runs = _sim_runs(tmp_path, ("schedule=ar",), ("schedule=sync",), ("schedule=async",),
                     ("schedule=sync", "schedule.gamma=2"))
    md = build_report([runs], tmp_path / "r").read_text()
    assert "Best γ" not in md and not (tmp_path / "r" / "throughput_vs_gamma.png").exists()


def test_gamma_section_for_one_schedule_leaves_ar_out(tmp_path: Path) -> None:
    runs = _sim_runs(tmp_path, ("schedule=ar",), *(("schedule=sync", f"schedule.gamma={g}") for g in (1, 2, 3)))
    md = build_report([runs], tmp_path / "r").read_text()
    assert (tmp_path / "r" / "throughput_vs_gamma.png").exists()
    header, _, *rows = md.split("Best γ:")[1].split("\n\n")[1].splitlines()
    col = [c.strip() for c in header.split("|")].index("γ")
    assert len(rows) == 1 and rows[0].split("|")[col].strip() in ("1", "2", "3")  # not ar's 0


def _captured_figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The figures the report sections save, by file name, kept open for inspection."""
    import testbed.report.sections as sections
    import testbed.report.sections_sim as sections_sim
    import testbed.report.sections_split as sections_split
    from testbed.report import style

    figs: dict[str, Any] = {}

    def keep(fig: Any, path: Any) -> None:
        fig.canvas.draw()
        figs[Path(path).name] = fig
        fig.savefig(path, dpi=100)

    for mod in (style, sections, sections_sim, sections_split):
        monkeypatch.setattr(mod, "savefig", keep)
    return figs


def legends_inside_axes(fig: Any) -> list[str]:
    """Titles of the axes whose legend overlaps the plotting area (it may cover a bar)."""
    renderer = fig.canvas.get_renderer()
    return [ax.get_title() for ax in fig.axes if ax.get_legend() is not None
            and ax.get_legend().get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))]


def test_bar_chart_legends_cover_no_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured GPU split's bars and the throughput bars (with the `ar` baseline ticks)."""
    from testbed.report.sections_split import _plot

    figs = _captured_figures(monkeypatch)
    pairs = pd.DataFrame({"pair": "p", "hardware": "local", "workload": "humaneval", "temperature": 0.0,
                          "split": ["t1", "sync", "ar"], "target_gpus": [1, 2, 2], "draft_gpus": [1, 2, 0],
                          "predicted_tokens_per_s": [10.0, 12.0, 8.0], "measured_tokens_per_s": [11.0, 12.5, 8.5],
                          "best_predicted": [False, True, False], "best_measured": [False, True, False]})
    _plot(pairs, str(tmp_path / "gpu_split_measured.png"))
    runs = _sim_runs(tmp_path, ("schedule=sync",), ("schedule=async",))
    build_report([runs], tmp_path / "r")
    for name in ("gpu_split_measured.png", "throughput.png"):
        assert not legends_inside_axes(figs[name]), name
    assert not clipped_figures(tmp_path) and not clipped_figures(tmp_path / "r")


def test_gantt_legend_covers_no_bar_and_devices_are_cores_on_local(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    figs = _captured_figures(monkeypatch)
    runs = _sim_runs(tmp_path, ("schedule=async", "hardware=local", "placement.target_gpus=1",
                                "placement.draft_gpus=1"))
    build_report([runs], tmp_path / "r")
    fig = figs["gantt.png"]
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
        assert "GPUs" not in ax.get_title() and "cores" in ax.get_title()
    assert not clipped_figures(tmp_path / "r")


def test_heatmap_colour_bar_label_is_inside_the_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep of many runs (`+sweep=wan`: 60): one heatmap row per run and a labelled colour bar,
    whose label tight_layout used to push past the figure's right edge."""
    import copy

    figs = _captured_figures(monkeypatch)
    exp = compose_exp("schedule=sync", "hardware=local")
    for seed in range(60):
        e = copy.deepcopy(exp)
        e.seed, e.pair.name = seed, ("llama3_70b+llama3_2_3b", "llama3_8b+llama3_2_1b")[seed % 2]
        rec = RunRecorder()
        for r in range(1 + seed % 4):
            rec.round(request_id=0, round_idx=r, start_s=r * 0.01, end_s=(r + 1) * 0.01, drafted=4,
                      checked=1 + r % 4, accepted=r % 4, emitted=1 + r % 4, verified_tokens=5)
        rec.request(RequestRecord(request_id=0, prompt_id="p0", prompt_len=10, output_ids=[], generated=10,
            prefill_s=0.1, decode_s=0.1, rounds=1 + seed % 4))
        write_run(tmp_path / "runs" / str(seed), e, RunResult(recorder=rec))
    build_report([tmp_path / "runs"], tmp_path / "r")
    fig = figs["accepted_length.png"]
    renderer = fig.canvas.get_renderer()
    labels = [ax.yaxis.label for ax in fig.axes if ax.yaxis.label.get_text()]
    assert any(t.get_text() == "share of verifications" for t in labels)
    for text in labels:
        box = text.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, f"{text.get_text()!r} cut off: {box}"
    assert not clipped_figures(tmp_path / "r")


def test_a_figure_with_text_past_its_edge_counts_as_clipped(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, x in (("inside.png", 0.5), ("cut.png", 0.97)):
        fig = plt.figure(figsize=(3, 2))
        fig.text(x, 0.5, "MWMWMWMWMW", ha="center", fontsize=14)
        fig.savefig(tmp_path / name, dpi=100)
        plt.close(fig)
    assert [c.split(":")[0] for c in clipped_figures(tmp_path)] == ["cut.png"]


def test_gamma_figure_legend_names_the_hue_for_a_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`+sweep=gamma` varies α beside γ: the legend reads "α (set)", not `alpha_config`."""
    figs = _captured_figures(monkeypatch)
    runs = _sim_runs(tmp_path, *(("sim.cost_model=analytic", f"schedule.gamma={g}", f"acceptance.alpha={a}")
                                 for g in (1, 3) for a in (0.6, 0.8)))
    build_report([runs], tmp_path / "r")
    titles = {ax.get_legend().get_title().get_text() for ax in figs["throughput_vs_gamma.png"].axes
              if ax.get_legend() is not None}
    assert titles == {"α (set)"}
