"""What a run records, identically on both backends: rounds, requests and timeline spans.

Backends call the recorder from their schedules; appends are plain tuples into lists so the
simulator's hot loop stays cheap. ``frames()`` turns them into the three DataFrames whose
schema the README's output table documents (rounds.parquet, requests.parquet, timeline.parquet).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

ROUND_COLUMNS = [
    "request_id", "round", "start_s", "end_s", "drafted", "checked", "accepted", "emitted",
    "verified_tokens", "draft_s", "target_s",
]
REQUEST_COLUMNS = [
    "request_id", "prompt_id", "prompt_len", "generated", "prefill_s", "decode_s", "rounds",
    "tokens_per_s", "output_ids", "arrival_s", "queue_s", "first_token_s", "finish_s",
]
# batch: the requests one span served (a batched round under load; 1 otherwise)
TIMELINE_COLUMNS = ["resource", "kind", "start_s", "end_s", "request_id", "round", "batch"]
NAN = float("nan")


@dataclass(frozen=True)
class RequestRecord:
    """One served request (a row of requests.parquet; ``tokens_per_s`` is derived)."""

    request_id: int
    prompt_id: str
    prompt_len: int
    output_ids: list[int]  # the generated tokens
    generated: int  # len(output_ids), or what counted as generated
    prefill_s: float
    decode_s: float  # from the first decode step to the last token
    rounds: int  # verifications (or AR forwards)
    # under load (testbed/arrivals.py), on the run's clock: when it arrived, how long it waited
    # for admission, when its first and last tokens were out; NaN when served one at a time
    arrival_s: float = NAN
    queue_s: float = NAN
    first_token_s: float = NAN
    finish_s: float = NAN


@dataclass
class RunRecorder:
    rounds: list[tuple] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    spans: list[tuple] = field(default_factory=list)
    extra_round_columns: dict[str, list[Any]] = field(default_factory=dict)
    keep_spans: bool = True

    def round(self, *, request_id: int, round_idx: int, start_s: float, end_s: float,
              drafted: int, checked: int, accepted: int, emitted: int, verified_tokens: int,
              draft_s: float = 0.0, target_s: float = 0.0) -> None:
        """One verification (or one AR forward): `drafted` guesses proposed (γ, or tree nodes
        sent), `checked` guesses on the verified path (accepted ones plus the first rejected
        one, if any), `accepted` kept, `emitted` tokens appended to the output (accepted +
        bonus, truncated at max_new_tokens), `verified_tokens` tokens in the target forward."""
        self.rounds.append((request_id, round_idx, start_s, end_s, drafted, checked, accepted,
                            emitted, verified_tokens, draft_s, target_s))

    def span(self, resource: str, kind: str, start_s: float, end_s: float, *,
             request_id: int = -1, round_idx: int = -1, batch: int = 1) -> None:
        if self.keep_spans:
            self.spans.append((resource, kind, start_s, end_s, request_id, round_idx, batch))

    def request(self, r: RequestRecord) -> None:
        self.requests.append({
            "request_id": r.request_id, "prompt_id": r.prompt_id, "prompt_len": r.prompt_len,
            "generated": r.generated, "prefill_s": r.prefill_s, "decode_s": r.decode_s,
            "rounds": r.rounds,
            "tokens_per_s": r.generated / r.decode_s if r.decode_s > 0 else float("nan"),
            "output_ids": list(r.output_ids),
            "arrival_s": r.arrival_s, "queue_s": r.queue_s, "first_token_s": r.first_token_s,
            "finish_s": r.finish_s,
        })

    def frames(self) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        rounds = pd.DataFrame.from_records(self.rounds, columns=ROUND_COLUMNS)
        for col, values in self.extra_round_columns.items():
            rounds[col] = values
        requests = pd.DataFrame(self.requests, columns=REQUEST_COLUMNS)
        timeline = pd.DataFrame.from_records(self.spans, columns=TIMELINE_COLUMNS)
        return rounds, requests, timeline


@dataclass
class RunResult:
    """What a backend returns: the recorded run, its `ar` baseline (if run) and extras."""

    recorder: RunRecorder
    baseline: RunRecorder | None = None  # `ar` on the same prompts, for `speedup`
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific summary fields
    artifacts: dict[str, Any] = field(default_factory=dict)  # extra files: name -> DataFrame/dict
