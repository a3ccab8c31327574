"""Prompt workloads shared by both backends: loading, splitting, selecting and rendering.

The real sets live in data/NAME.jsonl (written once by scripts/extract_workloads.py; provenance
and licenses in data/SOURCES.md). Nothing here touches the network or the source packages.

Determinism: splits and selections are keyed by SHA-256 of the prompt id (not Python's salted
`hash`, not `random`), so they are identical across runs, machines and Python versions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import backends
from testbed.paths import DATA_DIR

REAL_WORKLOADS = ("humaneval", "mtbench", "alpaca")
KINDS = ("code", "chat", "instruction")
# calibrate | holdout: the two halves of a set (the trained draft learned from `calibrate` only).
# trace | test: the two halves of `holdout`, for validating predictions with a draft trained on
# `calibrate`: acceptance traces come from `trace`, the measured/predicted runs use `test`, so
# neither side has seen the draft's training prompts (which inflate acceptance).
SPLITS = ("all", "calibrate", "holdout", "trace", "test")
# which split's recorded runs may drive predictions for a given split (acceptance=trace)
TRACE_SOURCE = {"holdout": "calibrate", "test": "trace", "all": "calibrate"}
TRACE_SPLITS = frozenset(TRACE_SOURCE.values())
EXTRACT_CMD = "python scripts/extract_workloads.py"


class WorkloadError(RuntimeError):
    """A workload cannot be loaded (unknown name, missing or malformed data file)."""


@dataclass
class Prompt:
    id: str
    kind: str  # "code" (completion style) | "chat" (multi-turn) | "instruction" (single turn)
    text: str  # the code prompt, or the first user turn
    turns: list[str]  # all user turns; assistant turns come from the model being run
    category: str | None
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. HumanEval entry_point


def load_prompts(name: str, data_dir: Path | None = None) -> list[Prompt]:
    """All prompts of a real workload, in file order."""
    if name not in REAL_WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r}; real workloads are {REAL_WORKLOADS}")
    path = (data_dir or DATA_DIR) / f"{name}.jsonl"
    if not path.is_file():
        raise WorkloadError(f"workload file {path} is missing; create it with `{EXTRACT_CMD}`")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(_parse_row(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                raise WorkloadError(
                    f"{path}:{lineno}: malformed row ({e}); regenerate with `{EXTRACT_CMD}`"
                ) from e
    return prompts


def _parse_row(row: dict[str, Any]) -> Prompt:
    turns = row["turns"]
    if row["kind"] not in KINDS:
        raise ValueError(f"kind {row['kind']!r} not in {KINDS}")
    if not turns or not all(isinstance(t, str) for t in turns) or turns[0] != row["prompt"]:
        raise ValueError("turns must be a non-empty list of str starting with prompt")
    return Prompt(
        id=str(row["id"]),
        kind=row["kind"],
        text=row["prompt"],
        turns=list(turns),
        category=row["category"],
        meta=dict(row.get("meta") or {}),
    )


def _unit_hash(*parts: object) -> float:
    """A stable pseudo-random number in [0, 1) from its arguments."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_prompts(
    prompts: Sequence[Prompt], split: str, seed: int = 0, holdout_frac: float = 0.5
) -> list[Prompt]:
    """The `split` part of `prompts` (see SPLITS), in input order.

    A prompt is in the holdout when sha256("split:seed:id") maps below `holdout_frac`; the rest
    calibrate. Membership depends only on (id, seed, holdout_frac), so calibration runs and the
    validation that predicts the holdout see disjoint prompts whatever the order or subset.
    `trace` and `test` halve the holdout by sha256("subsplit:seed:id") < 0.5.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= holdout_frac <= 1.0:
        raise ValueError(f"holdout_frac must be in [0, 1], got {holdout_frac}")
    if split == "all":
        return list(prompts)
    want_holdout = split != "calibrate"
    part = [p for p in prompts if (_unit_hash("split", seed, p.id) < holdout_frac) == want_holdout]
    if split in ("trace", "test"):  # halves of the holdout, by a hash independent of the split's
        part = [p for p in part if (_unit_hash("subsplit", seed, p.id) < 0.5) == (split == "trace")]
    return part


def select(prompts: Sequence[Prompt], num_prompts: int, seed: int = 0) -> list[Prompt]:
    """The first `num_prompts` after a deterministic shuffle by `seed`.

    The shuffle orders prompts by sha256("select:seed:id") (a key independent of the split's),
    so a larger `num_prompts` extends a smaller selection rather than replacing it. If
    `num_prompts` exceeds the set, the whole shuffled set is returned.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    ordered = sorted(prompts, key=lambda p: (_unit_hash("select", seed, p.id), p.id))
    return ordered[:num_prompts]


def workload_prompts(
    name: str, num_prompts: int, *, split: str = "all", seed: int = 0, holdout_frac: float = 0.5
) -> list[Prompt]:
    """load -> split -> select: the prompts one experiment runs."""
    return select(split_prompts(load_prompts(name), split, seed, holdout_frac), num_prompts, seed)


def chat_messages(prompt: Prompt, replies: Sequence[str] = ()) -> list[dict[str, str]]:
    """Messages for the next user turn: user turns interleaved with the model's earlier replies.

    With no replies this is the first turn; MT-bench's second turn needs the model's own answer
    to the first, which only exists after generation.
    """
    if len(replies) >= len(prompt.turns):
        raise ValueError(f"{prompt.id}: {len(replies)} replies but only {len(prompt.turns)} turns")
    messages = []
    for user, reply in zip(prompt.turns, replies):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": prompt.turns[len(replies)]})
    return messages


def render(
    prompt: Prompt, tokenizer: Any = None, chat_template: bool = True, replies: Sequence[str] = ()
) -> str | list[int]:
    """What is fed to the model for `prompt` (its first turn unless `replies` are given).

    Code prompts are returned as raw text: HumanEval is completion style (the model continues
    the function body). Chat and instruction prompts go through
    `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` when a tokenizer is
    given and `chat_template` is true (its result, str or token ids, is returned as is);
    otherwise the raw user text is returned.
    """
    if prompt.kind == "code" or tokenizer is None or not chat_template:
        if replies:
            raise ValueError("replies need a chat template (tokenizer) to be rendered")
        return prompt.text
    apply = getattr(tokenizer, "apply_chat_template", None)
    if not callable(apply):
        raise TypeError(f"{type(tokenizer).__name__} has no apply_chat_template(messages, ...)")
    return apply(chat_messages(prompt, replies), add_generation_prompt=True)


def synthetic_prompt_lengths(num_prompts: int, prompt_len: int, seed: int = 0) -> list[int]:
    """Prompt lengths (tokens) of the synthetic workload: all equal to `prompt_len`.

    Equal lengths keep synthetic runs free of length variance, so differences come from the
    schedule alone; `seed` is accepted for a uniform signature and currently unused.
    """
    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(
            f"need num_prompts >= 1 and prompt_len >= 1, got {num_prompts}, {prompt_len}"
        )
    del seed
    return [prompt_len] * num_prompts


def choose_prompts(exp: Any) -> list[Prompt]:
    """The prompts an experiment runs (both backends call this: same prompts, same order)."""
    w = exp.workload
    prompts = workload_prompts(w.name, w.num_prompts, split=w.split, seed=exp.seed)
    if len(prompts) < w.num_prompts:  # said once per process, not once per job of a sweep
        _warn_once(f"warning: workload.num_prompts={w.num_prompts} clipped to {len(prompts)}: "
                   f"the {w.name} set (split {w.split}) has {len(prompts)} prompts")
    return prompts


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    import sys

    if message not in _WARNED:
        _WARNED.add(message)
        print(message, file=sys.stderr)


BYTES_PER_TOKEN = 4.0  # typical for English/code under a ~50k BPE vocabulary


def count_tokens(prompts: Sequence[Prompt], exp: Any) -> list[int]:
    """Prompt lengths in tokens for the simulator: exact with the bundled tokenizer when the
    real backend's tokenizer can be loaded, else len(utf-8 bytes) / BYTES_PER_TOKEN."""
    try:
        load_tokenizer = backends.hook("tokenizer")  # a backend's (real's), via the registry
        tok = load_tokenizer() if load_tokenizer is not None else None
    except Exception:  # noqa: BLE001 - any failure means "no tokenizer here": fall back
        tok = None
    out = []
    for p in prompts:
        if tok is not None:
            rendered = render(p, tok, exp.workload.chat_template)
            out.append(len(rendered) if isinstance(rendered, list) else len(tok.encode(rendered)))
        else:
            out.append(max(1, round(len(p.text.encode()) / BYTES_PER_TOKEN)))
    return out
