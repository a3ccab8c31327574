"""`+calibrate` on the bundled model with a tiny grid: the profile it writes is one the `profile`
cost model reads, and the simulator runs on it. (No timing asserts: only structure and sanity.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specbed_kernels import preferred_dtype
from tests.conftest import compose_exp

pytest.importorskip("gguf")


def test_quick_calibration_feeds_the_profile_cost_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from functools import partial

    from real.calibrate import tree as calibrate_tree
    from real.calibrate.batch import BATCH_CONTEXT
    from real.calibrate.profile import PROFILE_THREADS, SCHEMA, TEMPERATURES, Grid, calibrate
    from sim.cost.profile import ProfileCost
    from sim.runtime.engine import run as sim_run

    # the tree tables' own grid shrunk as Grid.quick() shrinks the others (at full size they
    # were 60 % of this test's time; test_calibrate_tree checks what they measure)
    for name in ("time_expansions", "time_bookkeeping", "time_ngram_expansions"):
        monkeypatch.setattr(calibrate_tree, name, partial(getattr(calibrate_tree, name), leaves=(1, 2, 4), passes=3))
    # real.threads unset, as `backend=real +calibrate` runs: the threads the sweeps run at
    exp = compose_exp("backend=real", "pair=smollm2_135m+smollm2_exit10")
    grid = Grid.quick()
    path = calibrate(exp, run_dir=tmp_path / "run", grid=grid, log=lambda _: None, messages=False, tp=False,
                     out_path=tmp_path / "local.json")
    prof = json.loads(path.read_text())
    # real.dtype=auto, resolved for this host: the profile records what it measured
    assert prof["schema"] == SCHEMA and prof["threads"] == PROFILE_THREADS == 1
    assert prof["dtype"] == preferred_dtype("cpu")
    assert prof["cores"] >= 1  # what TP degrees it could measure
    assert (tmp_path / "run" / "profile.json").exists()
    assert {"smollm2_135m", "smollm2_exit10", "ngram3"} <= set(prof["models"])
    fwd = prof["models"]["smollm2_135m"]["forward"]["greedy"]
    assert len(fwd["seconds"]) == len(grid.context) and len(fwd["seconds"][0]) == len(grid.target_k)
    from testbed.spec.sampling import SAMPLING_MODES
    for name in ("smollm2_135m", "smollm2_exit10"):  # per mode, on the model's vocabulary
        node = prof["models"][name]["sampling"]
        assert set(node["seconds"]) == set(SAMPLING_MODES) and node["vocab"] == 49152
    assert "sampling" not in prof["models"]["ngram3"]  # one-hot q: nothing to standardize
    for table in ("tree_expand", "tree_rounds"):  # the n-gram draft's tree tables, per temperature class
        assert set(prof["models"]["ngram3"][table]) == set(TEMPERATURES)
        # an eagle head's: beyond its own forwards, which the simulator reads from its batched table
        assert set(prof["models"]["smollm2_eagle"][table]) == set(TEMPERATURES)
    expand = prof["models"]["smollm2_eagle"]["tree_expand"]["greedy"]
    one_step = prof["models"]["smollm2_eagle"]["forward"]["greedy"]["seconds"][0][0]
    assert expand["leaves"] == [1, 2, 4] and 0 < expand["seconds"][0] < one_step  # its forward subtracted
    batch = prof["models"]["smollm2_135m"]["batch"]["greedy"]  # continuous batching (real/calibrate/batch.py)
    assert batch["batch"] == grid.batches and batch["k"] == grid.batch_target_k
    assert len(batch["seconds"]) == len(grid.batches) and all(v > 0 for row in batch["seconds"] for v in row)
    assert "batch" not in prof["models"]["smollm2_exit10"]  # shares the target's forward: not batched
    for draft in ("smollm2_draft", "smollm2_eagle"):  # a draft model's steps, an eagle head's batched steps
        batch = prof["models"][draft]["batch"]["greedy"]
        assert batch["batch"] == grid.batches and batch["k"] == grid.batch_draft_k
        assert all(v > 0 for row in batch["seconds"] for v in row)
    for row in fwd["seconds"]:  # smoothed tables never decrease in k
        assert all(b >= a > 0 for a, b in zip(row, row[1:]))
    sim = compose_exp("pair=smollm2_135m+smollm2_exit10", "hardware=local", "sim.cost_model=profile",
                      f"sim.profile_path={path}", "workload.num_prompts=1", "workload.max_new_tokens=8",
                      "workload.prompt_len=32")
    cost = ProfileCost(sim)
    assert cost.forward("target", 5, 40) > cost.forward("draft", 1, 40) > 0
    summary = sim_run(sim).recorder.frames()[1]
    assert summary["tokens_per_s"].iloc[0] > 0
    # under load an eagle head's batched steps are priced from its own table, not added up
    eagle = ProfileCost(compose_exp("pair=smollm2_135m+smollm2_eagle", "hardware=local", "sim.cost_model=profile",
                                    f"sim.profile_path={path}"))
    two = prof["models"]["smollm2_eagle"]["batch"]["greedy"]["seconds"][grid.batches.index(2)][0]
    assert eagle.batch_forward("draft", [(1, BATCH_CONTEXT)] * 2) == pytest.approx(two)


@pytest.mark.slow
def test_gloo_message_benchmark_fits_alpha_beta() -> None:
    from real.calibrate.links import measure_messages

    res = measure_messages([4, 65536, 4194304], repeats=20)
    assert res["alpha_s"] >= 0 and res["beta_s_per_byte"] > 0
    assert res["seconds"][-1] > res["seconds"][0]


def test_batched_tables_never_decrease_in_tokens_or_requests() -> None:
    from real.calibrate.batch import monotone_2d

    raw = [[23.1, 19.5, 29.0], [20.3, 22.3, 29.7], [33.5, 59.1, 55.0], [61.1, 51.3, 118.5]]
    t = monotone_2d(raw)
    assert all(b >= a for row in t for a, b in zip(row, row[1:]))
    assert all(b >= a for col in zip(*t) for a, b in zip(col, col[1:]))
    assert t[3][2] == 118.5 and t[1][2] == 29.7  # cells without a violation kept
    assert min(map(min, raw)) <= min(map(min, t)) and max(map(max, t)) <= max(map(max, raw))


def test_probes_find_the_caches_evicted_where_the_profile_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's draft probes and the profile's each start after a cache eviction, so that their
    ratio is the machine's drift, not whether the draft's weights were still cached; the
    target's, timed warm in both, do not."""
    from real.calibrate import probe_forward
    from real.calibrate import profile as calib_profile

    events: list[str] = []
    monkeypatch.setattr(probe_forward, "evict_caches", lambda: events.append("evict"))
    monkeypatch.setattr(calib_profile, "evict_caches", lambda: events.append("evict"))
    fns = {"target": lambda: events.append("target"), "draft": lambda: events.append("draft")}
    probe_forward.time_functions(fns, repeats=2, warmup=1, cold=["draft"])
    assert events == ["target", "evict", "draft"] * 3

    events.clear()
    pr = calib_profile.Probes()
    pr.add(("target", 1), lambda: events.append("target"))
    pr.add(("draft", 1), lambda: events.append("draft"), cold=True)
    pr.run(passes=3)
    timed = events[2:]  # after the warm-up calls
    assert timed.count("evict") == 3 and timed.count("target") == 3
    assert all(timed[i - 1] == "evict" for i, e in enumerate(timed) if e == "draft")
    assert all(i == 0 or timed[i - 1] != "evict" for i, e in enumerate(timed) if e == "target")


def test_the_eviction_buffer_is_twice_the_last_level_cache() -> None:
    from real.calibrate import probe_forward

    llc = probe_forward.last_level_cache_bytes()
    assert llc >= 1 << 20
    probe_forward.evict_caches()
    assert probe_forward._EVICT[0].numel() * 4 == 2 * llc
