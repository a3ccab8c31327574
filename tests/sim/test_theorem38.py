"""Leviathan et al. Theorem 3.8 / Table 4 reproduced by the simulator (analytic cost, iid)."""

from __future__ import annotations

import pytest

from sim.runtime.engine import run
from testbed.results import build_summary
from testbed.theory import expected_tokens, leviathan_speedup
from tests.conftest import compose_exp

# Seed 001, Table 4 (task, M_q, temperature omitted): α, γ, c, Exp.
TABLE4 = [
    (0.75, 7, 0.02, 3.2), (0.80, 7, 0.04, 3.3), (0.82, 7, 0.11, 2.5),
    (0.62, 7, 0.02, 2.3), (0.68, 5, 0.04, 2.4), (0.71, 3, 0.11, 2.0),
    (0.65, 5, 0.02, 2.4), (0.73, 5, 0.04, 2.6), (0.74, 3, 0.11, 2.0),
    (0.53, 5, 0.02, 1.9), (0.55, 3, 0.04, 1.8), (0.56, 3, 0.11, 1.6),
]
# Two printed Exp values are not Theorem 3.8 at the printed (rounded) α and c: (0.71, 3, 0.11)
# gives 1.934 (printed 2.0) and (0.56, 3, 0.11) gives 1.541 (printed 1.6). The paper evidently
# used unrounded α/c there. Those rows are checked against the theorem, not the printed value.
PRINTED_OFF = {(0.71, 3, 0.11), (0.56, 3, 0.11)}


def simulate(alpha: float, gamma: int, c: float, seed: int = 0) -> dict:
    exp = compose_exp("schedule=sync", "sim.cost_model=analytic", f"sim.c={c}", "acceptance=iid",
                      f"acceptance.alpha={alpha}", f"schedule.gamma={gamma}",
                      "workload.num_prompts=4", "workload.max_new_tokens=6000", f"seed={seed}")
    return build_summary(exp, run(exp))


@pytest.mark.parametrize("alpha,gamma,c,printed", TABLE4)
def test_table4_row(alpha: float, gamma: int, c: float, printed: float) -> None:
    s = simulate(alpha, gamma, c)
    theorem = leviathan_speedup(alpha, gamma, c)
    assert s["speedup"] == pytest.approx(theorem, rel=0.02)
    if (alpha, gamma, c) not in PRINTED_OFF:
        assert s["speedup"] == pytest.approx(printed, rel=0.03)
    assert s["mean_accepted_len"] == pytest.approx(expected_tokens(alpha, gamma), rel=0.02)
    assert s["alpha"] == pytest.approx(alpha, abs=0.02)


def test_printed_exceptions_are_really_off() -> None:
    """Guard the exception list: the theorem misses exactly those printed values by > 3%."""
    for alpha, gamma, c, printed in TABLE4:
        off = abs(leviathan_speedup(alpha, gamma, c) - printed) / printed > 0.03
        assert off == ((alpha, gamma, c) in PRINTED_OFF)


def test_wrong_acceptance_rule_would_fail() -> None:
    """Negative control: a simulator that accepted with α^2 would miss eq. (1) by far more than 2%."""
    alpha, gamma = 0.75, 7
    assert abs(expected_tokens(alpha**2, gamma) / expected_tokens(alpha, gamma) - 1) > 0.2
