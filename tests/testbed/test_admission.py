"""testbed/admission.py: FCFS admission within serving.max_batch and the KV budget (both
backends' rule), and the one-line refusal of a request that could never fit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from testbed.admission import Admission, kv_need, refuse_oversized, window_of
from testbed.config import ConfigError
from tests.conftest import compose_exp


@dataclass(frozen=True)
class Req:
    request_id: int
    prompt_id: str
    prompt_len: int
    max_new_tokens: int


def test_admission_is_fcfs_within_the_batch_bound_and_the_kv_budget() -> None:
    exp = compose_exp("schedule=sync", "schedule.gamma=3", "workload.concurrency=8", "serving.max_batch=3",
                      "serving.kv_budget_tokens=100")
    assert window_of(exp) == 4
    q = Admission(exp)
    reqs = [Req(i, f"p{i}", 20 + 10 * (i % 3), 16) for i in range(6)]  # needs 40, 50, 60, 40, ...
    for i, r in enumerate(reqs):
        q.arrive(r, float(i))
    first = q.admit(0)
    assert [r.request_id for r, _ in first] == [0, 1]  # 40 + 50 fit, 60 more would not
    assert q.kv_used == 90 <= 100
    assert q.admit(2) == []  # the head of the queue (60) waits; nothing overtakes it
    q.release(reqs[0])
    q.release(reqs[1])
    second = q.admit(0)
    assert [r.request_id for r, _ in second] == [2, 3] and [t for _, t in second] == [2.0, 3.0]
    q.release(reqs[2])
    q.release(reqs[3])
    assert [r.request_id for r, _ in q.admit(1)] == [4]  # 50; then 60 exceeds the budget
    assert q.kv_used == kv_need(reqs[4], 4) <= 100


def test_the_batch_bound_alone() -> None:
    q = Admission(compose_exp("workload.concurrency=8", "serving.max_batch=2"))
    for i in range(5):
        q.arrive(Req(i, "p", 10, 10), 0.0)
    assert len(q.admit(0)) == 2 and q.admit(2) == [] and len(q.admit(1)) == 1


def test_a_request_that_could_never_fit_is_refused_with_one_line() -> None:
    exp = compose_exp("workload.concurrency=2", "serving.kv_budget_tokens=50", "schedule=ar")
    refuse_oversized(exp, [Req(0, "a", 20, 20)])  # 41 slots: fits
    with pytest.raises(ConfigError, match="request 1 \\(b\\) needs its prompt \\(40\\)"):
        refuse_oversized(exp, [Req(0, "a", 20, 20), Req(1, "b", 40, 20)])
