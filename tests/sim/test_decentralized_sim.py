"""`decentralized` (DSD) in the simulator: closed-form speedup, pipeline timing, adaptive rule.

Theory check. With `sim.cost_model=analytic acceptance=iid`, zero jitter and unlimited bandwidth
(so a hop takes exactly the latency t1 = network.latency_ms), a round costs γ·c·t0 + t0 + L·t1
and an `ar` token t0 + L·t1, where t0 = sim.t_target_ms and L the links of one round trip. The
simulated pipeline is a closed loop: N−1 activation hops plus the return of the verified tokens,
L = N. DSD's formula E·(t0+(N−1)t1)/(γ·c·t0+t0+(N−1)t1) is evaluated with its communication term
set to L·t1 (`dsd_speedup(..., nodes=L+1)`); read literally with N−1 links it differs, and the
test below shows by how much.
"""

from __future__ import annotations

import pandas as pd
import pytest

from sim.runtime.engine import baseline_experiment, make_requests, run, simulate
from sim.schedules.decentralized import closed_loop_speedup
from testbed.config import ConfigError
from testbed.results import build_summary
from testbed.theory import dsd_comm_reduction, dsd_speedup
from tests.conftest import compose_exp

ANALYTIC = ("schedule=decentralized", "hardware=a800_nodes", "sim.cost_model=analytic",
            "acceptance=iid", "network.jitter_ms=0", "network.bandwidth_gbit_s=0")

# (alpha, gamma, c, nodes, t1_ms) with t0 = 25 ms
GRID = [(0.8, 4, 0.05, 2, 20.0), (0.6, 8, 0.1, 4, 50.0), (0.9, 3, 0.02, 8, 5.0),
        (0.7, 6, 0.2, 3, 100.0), (0.75, 8, 0.05, 8, 25.0), (0.85, 2, 0.0, 1, 0.0)]


def all_close(values: pd.Series, expected: float) -> bool:
    return len(values) > 0 and values.tolist() == pytest.approx([expected] * len(values))


def analytic(alpha: float, gamma: int, c: float, nodes: int, t1: float, *extra: str):  # type: ignore[no-untyped-def]
    return compose_exp(*ANALYTIC, f"acceptance.alpha={alpha}", f"schedule.gamma={gamma}",
                       f"sim.c={c}", f"placement.nodes={nodes}", f"network.latency_ms={t1}", *extra)


@pytest.mark.parametrize("alpha,gamma,c,nodes,t1", GRID)
def test_speedup_matches_dsd_closed_form(alpha: float, gamma: int, c: float, nodes: int, t1: float) -> None:
    exp = analytic(alpha, gamma, c, nodes, t1, "workload.num_prompts=4", "workload.max_new_tokens=2500")
    s = build_summary(exp, run(exp))
    t0 = exp.sim.t_target_ms
    links = nodes if nodes > 1 else 0
    assert s["links_per_round_trip"] == links
    assert s["t0_ms"] == pytest.approx(t0) and s["t1_ms"] == pytest.approx(t1)
    theory = dsd_speedup(alpha, gamma, c=c, t0=t0, t1=t1, nodes=links + 1)
    assert s["theory_speedup"] == pytest.approx(theory)
    assert s["speedup"] == pytest.approx(theory, rel=0.03)
    assert s["alpha"] == pytest.approx(alpha, abs=0.02)
    # the report's statement of DSD eq. (5), with the measured mean accepted length
    assert s["comm_reduction_eq5"] == pytest.approx(
        dsd_comm_reduction(s["mean_accepted_len"], t0, t1, links + 1))


def test_round_trip_crosses_n_links() -> None:
    """Every round takes exactly γ·c·t0 + t0 + N·t1; every `ar` token t0 + N·t1."""
    exp = analytic(0.8, 4, 0.05, 4, 20.0, "workload.num_prompts=1", "workload.max_new_tokens=60")
    req = make_requests(exp)
    rounds = simulate(exp, req, seed=0).frames()[0]
    assert all_close(rounds["end_s"] - rounds["start_s"], 4 * 0.05 * 0.025 + 0.025 + 4 * 0.020)
    base = baseline_experiment(exp)
    assert base.schedule.name == "ar" and base.placement.nodes == 4 and base.network == exp.network
    ar_rounds, _, ar_tl = simulate(base, req, seed=1).frames()
    assert all_close(ar_rounds["end_s"] - ar_rounds["start_s"], 0.025 + 4 * 0.020)
    assert {"stage0", "stage3", "link stage3->stage0"} <= set(ar_tl["resource"])
    # read with N−1 links the formula can miss a closed loop by more than the 3% tolerance
    assert abs(dsd_speedup(0.8, 4, c=0.2, t0=25, t1=25, nodes=2) / closed_loop_speedup(0.8, 4, c=0.2, t0=25, t1=25, links=2) - 1) > 0.03


def test_timeline_has_stages_draft_and_links() -> None:
    exp = analytic(0.8, 4, 0.05, 3, 10.0, "workload.num_prompts=1", "workload.max_new_tokens=20")
    tl = run(exp).recorder.frames()[2]
    assert set(tl["resource"]) == {"draft", "stage0", "stage1", "stage2", "link stage0->stage1",
                                   "link stage1->stage2", "link stage2->stage0"}
    links = tl[tl["kind"] == "link"]
    assert all_close(links["end_s"] - links["start_s"], 0.010)


SYNTH = ("schedule=decentralized", "hardware=a800_nodes", "network=wan", "acceptance=synthetic",
         "pair=llama3_8b+llama3_2_1b", "placement.nodes=3", "sampling.temperature=1",
         "workload.num_prompts=2", "workload.max_new_tokens=60")


def test_adaptive_tau_zero_is_plain_verification() -> None:
    plain = run(compose_exp(*SYNTH))
    tau0 = run(compose_exp(*SYNTH, "schedule.adaptive=true", "schedule.tau=0"))
    a, b = plain.recorder.frames(), tau0.recorder.frames()
    assert [list(x) for x in a[1]["output_ids"]] == [list(x) for x in b[1]["output_ids"]]
    assert a[0]["accepted"].tolist() == b[0]["accepted"].tolist()
    assert a[0]["end_s"].tolist() == b[0]["end_s"].tolist()
    assert plain.extra["key_token_fraction"] is None
    assert 0.0 <= tau0.extra["key_token_fraction"] <= 1.0
    relaxed = run(compose_exp(*SYNTH, "schedule.adaptive=true", "schedule.tau=0.6"))
    assert [list(x) for x in relaxed.recorder.frames()[1]["output_ids"]] != [list(x) for x in a[1]["output_ids"]]


def test_adaptive_needs_distributions() -> None:
    with pytest.raises(ConfigError) as e:
        compose_exp("schedule=decentralized", "schedule.adaptive=true", "acceptance=iid")
    assert e.value.key == "schedule.adaptive" and "synthetic" in str(e.value)


def test_ar_over_a_pipeline_is_its_own_schedule() -> None:
    """`schedule=ar placement.nodes=N` runs the pipeline too (and reports its network)."""
    exp = compose_exp("schedule=ar", "hardware=a800_nodes", "sim.cost_model=analytic",
                      "placement.nodes=2", "network.latency_ms=5", "network.jitter_ms=0",
                      "network.bandwidth_gbit_s=0", "workload.num_prompts=1", "workload.max_new_tokens=10")
    res = run(exp)
    rounds = res.recorder.frames()[0]
    assert all_close(rounds["end_s"] - rounds["start_s"], 0.025 + 2 * 0.005)
    assert res.extra["links_per_round_trip"] == 2


def test_an_eagle_draft_s_features_ride_back_with_the_verified_tokens(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The last stage's answers cost what real/runtime/pipeline.py sends (testbed.links): with an
    eagle draft the prompt's features after the prefill and the verified positions' features
    with the tokens; tokens only with another draft and in the `ar` baseline over the pipeline."""
    from sim.runtime.links import Link
    from testbed.links import dsd_prompt_answer_bytes, dsd_verified_bytes

    sent: list[tuple[str, float, int]] = []
    send = Link.send

    def record(self, nbytes, request_id=-1, round_idx=-1):  # type: ignore[no-untyped-def]
        sent.append((self.name, nbytes, round_idx))
        return send(self, nbytes, request_id, round_idx)

    monkeypatch.setattr(Link, "send", record)

    def answers(exp, seed: int = 0):  # type: ignore[no-untyped-def]
        sent.clear()
        rounds = simulate(exp, make_requests(exp), seed=seed).frames()[0]
        return rounds, [(n, r) for name, n, r in sent if name == "link stage1->stage0"]

    exp = analytic(0.8, 4, 0.05, 2, 5.0, "pair=llama3_8b+llama3_8b_eagle", "workload.num_prompts=1",
                   "workload.max_new_tokens=30")
    assert exp.pair.target.quant == "bf16"
    size = {"hidden": exp.pair.target.hidden, "act_bytes": 2}
    prompt_len = make_requests(exp)[0].prompt_len
    rounds, back = answers(exp)
    assert back[0] == (dsd_prompt_answer_bytes(prompt_len - 1, **size, features=True), -1)
    assert back[1:] == [(dsd_verified_bytes(a + 1, **size, features=True), r)
                        for a, r in zip(rounds.accepted, rounds["round"])]
    assert (rounds.accepted > 0).any()
    base_rounds, base_back = answers(baseline_experiment(exp), seed=1)
    assert base_back == [(dsd_verified_bytes(1, **size, features=False), r) for r in base_rounds["round"]]
    other = analytic(0.8, 4, 0.05, 2, 5.0, "pair=llama3_8b+llama3_2_1b", "workload.num_prompts=1",
                     "workload.max_new_tokens=30")
    rounds, back = answers(other)
    assert back == [(dsd_verified_bytes(a + 1, **size, features=False), r)
                    for a, r in zip(rounds.accepted, rounds["round"])]
