"""Sampling cost per mode: calibrated by real/calibrate/sampling.py, charged by the `profile`
cost model per drafted token and per verified distribution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from real.calibrate.sampling import measure_sampling
from sim.cost.profile import ProfileCost
from testbed.spec.sampling import SAMPLING_MODES, SamplingParams, sampling_mode
from tests.conftest import compose_exp
from tests.sim.test_cost_profile import make_profile

PAIR = ("pair=smollm2_135m+smollm2_exit10", "hardware=local", "sim.cost_model=profile")
# seconds per distribution: distinct per mode so a mix-up shows
TARGET_S = {"greedy": 1e-4, "temperature": 2e-4, "top_k": 5e-4, "top_p": 9e-4, "top_k_top_p": 6e-4}
DRAFT_S = {m: v / 2 for m, v in TARGET_S.items()}


def profile_with_sampling() -> dict:
    prof = make_profile()
    for name, secs in (("smollm2_135m", TARGET_S), ("smollm2_exit10", DRAFT_S)):
        prof["models"][name]["sampling"] = {"vocab": 49152, "seconds": dict(secs)}
    prof["models"]["smollm2_exit10"]["forward"]["sample"] = prof["models"]["smollm2_exit10"]["forward"]["greedy"]
    return prof


def test_sampling_mode_names_what_standardize_runs() -> None:
    assert sampling_mode(SamplingParams(0.0, top_k=5, top_p=0.5)) == "greedy"
    assert sampling_mode(SamplingParams(0.7)) == "temperature"
    assert sampling_mode(SamplingParams(0.7, top_k=50)) == "top_k"
    assert sampling_mode(SamplingParams(0.7, top_p=0.9)) == "top_p"
    assert sampling_mode(SamplingParams(0.7, top_k=50, top_p=0.9)) == "top_k_top_p"


def test_measure_sampling_times_every_mode_on_the_given_vocabulary() -> None:
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(0))
    node = measure_sampling(logits, passes=2)
    assert node["vocab"] == 1000 and set(node["seconds"]) == set(SAMPLING_MODES)
    assert all(v > 0 for v in node["seconds"].values())
    json.dumps(node)  # goes into the profile as is


@pytest.mark.parametrize("mode,overrides", [("top_p", ["sampling.top_p=0.9"]),
                                            ("top_k", ["sampling.top_k=50"]),
                                            ("top_k_top_p", ["sampling.top_k=50", "sampling.top_p=0.9"])])
def test_forward_charges_the_modes_extra_per_distribution(mode: str, overrides: list[str]) -> None:
    prof = profile_with_sampling()
    plain = ProfileCost(compose_exp(*PAIR, "sampling.temperature=0.7"), profile=prof)
    cost = ProfileCost(compose_exp(*PAIR, "sampling.temperature=0.7", *overrides), profile=prof)
    extra_t, extra_d = (s[mode] - s["temperature"] for s in (TARGET_S, DRAFT_S))
    for k in (1, 3, 8):  # a verification standardizes each of its k positions
        assert cost.forward("target", k, 256) - plain.forward("target", k, 256) == pytest.approx(k * extra_t)
    # a chain draft forward yields one guess, a tree expansion one distribution per node
    assert cost.forward("draft", 2, 256) - plain.forward("draft", 2, 256) == pytest.approx(extra_d)
    assert cost.tree_forward("draft", 4, 256) - plain.tree_forward("draft", 4, 256) == pytest.approx(4 * extra_d)


def test_greedy_and_old_profiles_charge_nothing_extra() -> None:
    with_node, without = profile_with_sampling(), make_profile()
    greedy = [ProfileCost(compose_exp(*PAIR), profile=p).forward("target", 4, 256) for p in (with_node, without)]
    assert greedy[0] == greedy[1]
    exp = compose_exp(*PAIR, "sampling.temperature=0.7", "sampling.top_p=0.9")
    old = ProfileCost(exp, profile=without)  # schema-2 profile from before: still readable
    assert old.sampling_extra_s == {"target": 0.0, "draft": 0.0}


def test_a_top_p_run_is_predicted_slower_by_the_calibrated_amount(tmp_path: Path) -> None:
    from sim.runtime.engine import make_requests, simulate

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_with_sampling()))
    base = (*PAIR, f"sim.profile_path={path}", "sampling.temperature=0.7", "workload.num_prompts=2",
            "workload.max_new_tokens=24", "schedule=sync", "schedule.gamma=3")
    runs = {}
    for name, extra in (("plain", ()), ("top_p", ("sampling.top_p=0.9",))):
        exp = compose_exp(*base, *extra)
        runs[name] = simulate(exp, make_requests(exp), seed=3)
    plain, top_p = (r.frames()[0] for r in (runs["plain"], runs["top_p"]))
    # the iid oracle draws the same acceptance: the same rounds, each dearer by its distributions
    assert list(plain["accepted"]) == list(top_p["accepted"])
    verified = int((top_p["drafted"] + 1).sum())
    drafted = int(top_p["drafted"].sum())
    want = verified * (TARGET_S["top_p"] - TARGET_S["temperature"]) + drafted * (DRAFT_S["top_p"] - DRAFT_S["temperature"])
    decode = [sum(r["decode_s"] for r in runs[n].requests) for n in ("plain", "top_p")]
    assert decode[1] - decode[0] == pytest.approx(want, rel=1e-6)
    assert want > 0


def test_a_dsd_draft_is_charged_the_top_k_sampling_it_runs() -> None:
    # DSD's draft samples from its top-k at temperature > 0 (testbed.spec.dsd.draft_params) so
    # its q travels exactly; the target keeps the run's plain temperature sampling
    prof = profile_with_sampling()
    dsd = ("schedule=decentralized", "placement.nodes=2", "sampling.temperature=0.7")
    topk = ProfileCost(compose_exp(*PAIR, *dsd), profile=prof)
    full = ProfileCost(compose_exp(*PAIR, *dsd, "schedule.draft_topk=0"), profile=prof)
    assert topk.sampling_extra_s["draft"] == pytest.approx(DRAFT_S["top_k"] - DRAFT_S["temperature"])
    assert full.sampling_extra_s["draft"] == 0.0
    assert topk.sampling_extra_s["target"] == full.sampling_extra_s["target"] == 0.0
