"""``real.repeats=N``: configurations interleaved (A ar A ar …, the baseline between the others
in every pass), summary fields with medians and 95% intervals, machine state around each."""

from __future__ import annotations

import pytest

from real.runtime.repeats import changed, serve_interleaved
from testbed.recorder import RunRecorder
from testbed.repeats import interleaved_order, repeat_summary
from tests.conftest import compose_exp
from tests.helpers.tiny_checkpoint import write_tiny_checkpoint


def test_order_alternates_and_puts_the_baseline_between_the_others() -> None:
    assert interleaved_order(["sync"], 3) == [("sync", 0), ("ar", 0), ("sync", 1), ("ar", 1),
                                              ("sync", 2), ("ar", 2)]
    order = [n for n, _ in interleaved_order(["A", "B", "C"], 4)]
    assert order[:4] == ["A", "ar", "B", "C"] and order[4:8] == ["A", "ar", "B", "C"]
    # no configuration measured twice in a row, and ar has another configuration on each side
    assert all(a != b for a, b in zip(order, order[1:]))
    for i, name in enumerate(order):
        if name == "ar":
            assert 0 < i < len(order) - 1 and "ar" not in (order[i - 1], order[i + 1])
    assert [n for n, _ in interleaved_order(["sync"], 2, baseline=None)] == ["sync", "sync"]
    with pytest.raises(ValueError, match="repeats"):
        interleaved_order(["sync"], 0)


def _fake_requests(tps: list[float]) -> list[dict]:
    return [{"generated": 100, "decode_s": 100 / v, "prefill_s": 0.0} for v in tps]


def test_serve_interleaved_measures_in_that_order_and_summarizes_every_pass() -> None:
    calls: list[str] = []
    speed = {"sync": [30.0, 40.0, 50.0, 60.0], "ar": [20.0, 25.0, 30.0, 35.0]}

    def measure(impl: str, extra: dict | None) -> RunRecorder:
        calls.append(impl)
        rec = RunRecorder()
        n = calls.count(impl)
        rec.requests = _fake_requests([v * (1 + 0.01 * n) for v in speed[impl]])
        if extra is not None:
            extra["schedule_field"] = n
        return rec

    extra: dict = {}
    rec, base, fields = serve_interleaved("sync", 3, baseline=True, measure=measure, schedule_extra=extra, probe=False)
    assert calls == ["sync", "ar"] * 3
    assert extra == {"schedule_field": 1}  # the schedule's own fields come from the first pass
    assert rec.requests[0]["decode_s"] == pytest.approx(100 / 30.3) and base is not None
    assert fields["repeats"] == 3 and fields["measure_order"] == ["sync#0", "ar#0", "sync#1", "ar#1", "sync#2", "ar#2"]
    lo, hi = fields["speedup_ci95"]
    assert lo <= fields["speedup_median"] <= hi and fields["speedup_median"] == pytest.approx(45.45 / 27.5, rel=0.02)
    lo, hi = fields["tokens_per_s_ci95"]
    assert 30 <= lo <= fields["tokens_per_s_median"] <= hi <= 61
    assert len(fields["machine_states"]) == 6 and len(fields["repeat_tokens_per_s"]["ar"]) == 3


def test_machine_change_is_flagged() -> None:
    before = {"load1": 0.5, "cpu_mhz": 2400.0, "bandwidth_gbps": 14.0}
    assert changed(before, dict(before)) == []
    assert changed(before, {**before, "load1": 3.0})[0].startswith("load")
    assert changed(before, {**before, "bandwidth_gbps": 9.0})[0].startswith("bandwidth")
    assert changed(before, {**before, "cpu_mhz": None}) == []  # not readable: no verdict


def test_repeat_summary_without_baseline_has_no_speedup() -> None:
    fields = repeat_summary({"ar": [_fake_requests([10.0, 11.0])] * 2}, "ar", baseline=None)
    assert "speedup_median" not in fields and fields["tokens_per_s_median"] == pytest.approx(10.5)


def test_real_run_with_repeats_writes_intervals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from real.runtime.engine import run

    target = write_tiny_checkpoint(tmp_path / "target", seed=1, layers=2)
    draft = write_tiny_checkpoint(tmp_path / "draft", seed=2, layers=2, base=target, noise=0.3)
    exp = compose_exp("backend=real", f"pair.target.path={target}", f"pair.draft.path={draft}",
                      "workload.num_prompts=2", "workload.max_new_tokens=6", "real.ignore_eos=true",
                      "real.progress=false", "schedule=sync", "schedule.gamma=2", "real.repeats=2")
    result = run(exp)
    x = result.extra
    assert x["measure_order"] == ["sync#0", "ar#0", "sync#1", "ar#1"]
    for key in ("tokens_per_s", "tpot_ms", "speedup"):
        lo, hi = x[f"{key}_ci95"]
        assert lo <= x[f"{key}_median"] <= hi
    assert result.baseline is not None and len(result.recorder.requests) == 2
    # summary.json carries them, and the report shows them with error bars
    from testbed.report import build_report
    from testbed.results import write_run

    summary = write_run(tmp_path / "run", exp, result)
    assert summary["repeats"] == 2 and len(summary["speedup_ci95"]) == 2
    md = build_report([tmp_path / "run"], tmp_path / "report", figures=True).read_text()
    assert "Repeated measurements" in md and (tmp_path / "report" / "repeats_error_bars.png").exists()
