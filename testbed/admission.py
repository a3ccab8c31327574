"""Admission under load, the same on both backends: one first-come, first-served queue, and
between rounds the server admits waiting requests while the batch holds fewer than
``serving.max_batch`` and their KV reservations fit ``serving.kv_budget_tokens``. A request
reserves its prompt, its ``max_new_tokens`` and one verification window at admission and frees
them when done, so admission alone keeps the cache within its budget (sim/runtime/batching.py,
real/runtime/batching.py). Also the per-request bookkeeping both backends' batched rounds share."""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from testbed.config import ConfigError
from testbed.schedules import spec_of


class Request(Protocol):
    request_id: int
    prompt_id: str

    @property
    def prompt_len(self) -> int: ...

    @property
    def max_new_tokens(self) -> int: ...


def kv_need(req: Request, window: int) -> int:
    """KV slots a request reserves from admission: its prompt, its output, one window."""
    return req.prompt_len + req.max_new_tokens + window


def window_of(exp: Any) -> int:
    """The verification window a request reserves KV slots for (γ + 1, a tree's bs nodes; `ar`:
    its one token)."""
    spec = spec_of(exp)
    if spec.tree:
        return exp.schedule.tree_budget
    return exp.schedule.gamma + 1 if spec.drafts else 1


def refuse_oversized(exp: Any, requests: list[Request]) -> None:
    """A request whose reservation exceeds ``serving.kv_budget_tokens`` could never be admitted:
    one ``ConfigError`` naming it, before anything runs."""
    budget, window = exp.serving.kv_budget_tokens, window_of(exp)
    for req in requests:
        if budget and kv_need(req, window) > budget:
            raise ConfigError("serving.kv_budget_tokens", budget, f"at least {kv_need(req, window)}: request "
                              f"{req.request_id} ({req.prompt_id}) needs its prompt ({req.prompt_len}) + "
                              f"max new tokens ({req.max_new_tokens}) + one window ({window}) of KV slots")


class Admission:
    """The FCFS queue and the KV reservations of one server."""

    def __init__(self, exp: Any) -> None:
        self.max_batch, self.budget = exp.serving.max_batch, exp.serving.kv_budget_tokens
        self.window = window_of(exp)
        self.waiting: deque[tuple[Request, float]] = deque()
        self.kv_used = 0

    def arrive(self, req: Request, at: float) -> None:
        self.waiting.append((req, at))

    def admit(self, running: int) -> list[tuple[Request, float]]:
        """The waiting requests that join a batch of ``running`` now, with their arrival times."""
        out: list[tuple[Request, float]] = []
        while self.waiting and (not self.max_batch or running + len(out) < self.max_batch) \
                and (not self.budget or self.kv_used + kv_need(self.waiting[0][0], self.window) <= self.budget):
            req, t = self.waiting.popleft()
            self.kv_used += kv_need(req, self.window)
            out.append((req, t))
        return out

    def release(self, req: Request) -> None:
        self.kv_used -= kv_need(req, self.window)


class Served(Protocol):
    """What the batched rounds of both backends keep per running request (their ``Active``)."""

    req: Request
    rounds: int
    first_token_s: float


def span_request(running: list[Served]) -> int:
    """A batched span's request: the one served, or -1 for a batch of several."""
    return running[0].req.request_id if len(running) == 1 else -1


def count_round(a: Served, now: float) -> None:
    """One more round of ``a``; its first round's end is its first token."""
    a.rounds += 1
    if a.rounds == 1:
        a.first_token_s = now


def mark_load(rec: Any, request_id: int, *, arrival: float, admit: float, finish: float,
              rounds_from: int) -> None:
    """Add the load fields to a request's row, which its one-request schedule recorded as when
    served alone (a pipeline's requests in flight, sim/runtime/pipelined.py and
    real/runtime/pipelined.py): arrival, queueing, its first round's end (its first token) and
    its finish. Its rounds are recorded from index ``rounds_from`` on (its admission)."""
    first = next((r[3] for r in rec.rounds[rounds_from:] if r[0] == request_id), float("nan"))
    row = next(r for r in reversed(rec.requests) if r["request_id"] == request_id)
    row.update(arrival_s=arrival, queue_s=admit - arrival, first_token_s=first, finish_s=finish)
