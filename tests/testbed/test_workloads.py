"""The shipped prompt sets and the workload loader (testbed/workloads.py)."""

from __future__ import annotations

import json

import pytest

from testbed.workloads import (
    DATA_DIR,
    Prompt,
    WorkloadError,
    load_prompts,
    render,
    select,
    split_prompts,
    synthetic_prompt_lengths,
    workload_prompts,
)

EXPECTED = {"humaneval": (164, "code"), "mtbench": (80, "chat"), "alpaca": (805, "instruction")}
SCHEMA = {"id", "kind", "prompt", "turns", "category", "source", "meta"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_counts_kinds_and_unique_ids(name: str) -> None:
    count, kind = EXPECTED[name]
    prompts = load_prompts(name)
    assert len(prompts) == count
    assert {p.kind for p in prompts} == {kind}
    assert len({p.id for p in prompts}) == count
    assert all(p.text and p.turns[0] == p.text for p in prompts)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_uniform_schema(name: str) -> None:
    lines = (DATA_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    for line in lines:
        row = json.loads(line)
        assert set(row) == SCHEMA
        assert isinstance(row["id"], str) and isinstance(row["source"], str) and row["source"]
        assert isinstance(row["turns"], list) and all(isinstance(t, str) for t in row["turns"])
        assert row["category"] is None or isinstance(row["category"], str)


def test_set_specific_shape() -> None:
    he = load_prompts("humaneval")
    assert he[0].id == "HumanEval/0" and he[0].category is None
    assert all(p.meta["entry_point"] in p.text for p in he)  # the prompt defines the function
    mt = load_prompts("mtbench")
    assert all(len(p.turns) == 2 for p in mt)
    assert len({p.category for p in mt}) == 8
    alpaca = load_prompts("alpaca")
    assert {p.category for p in alpaca} == {
        "helpful_base",
        "koala",
        "oasst",
        "selfinstruct",
        "vicuna",
    }


def test_sources_file_lists_every_set() -> None:
    text = (DATA_DIR / "SOURCES.md").read_text(encoding="utf-8")
    for name, (count, _) in EXPECTED.items():
        assert f"data/{name}.jsonl — {count} rows" in text
    assert "CC BY-NC 4.0" in text and "MIT" in text and "Apache-2.0" in text


@pytest.mark.parametrize("name", ["mtbench", "alpaca"])
def test_split_is_stable_partition(name: str) -> None:
    prompts = load_prompts(name)
    cal = split_prompts(prompts, "calibrate", seed=0)
    hold = split_prompts(prompts, "holdout", seed=0)
    cal_ids, hold_ids = {p.id for p in cal}, {p.id for p in hold}
    assert not cal_ids & hold_ids
    assert cal_ids | hold_ids == {p.id for p in prompts}
    assert cal and hold  # both halves non-empty at holdout_frac=0.5
    # Stable: same answer on a reversed copy and on a subset (membership depends on id only).
    assert {p.id for p in split_prompts(prompts[::-1], "holdout", seed=0)} == hold_ids
    assert {p.id for p in split_prompts(prompts[:20], "holdout")} == hold_ids & {
        p.id for p in prompts[:20]
    }
    assert split_prompts(prompts, "all") == prompts
    assert {p.id for p in split_prompts(prompts, "holdout", seed=1)} != hold_ids


@pytest.mark.parametrize("name", ["humaneval", "mtbench"])
def test_trace_and_test_halve_the_holdout(name: str) -> None:
    # The validate sweep takes acceptance traces on `trace` and measures on `test`: both must be
    # inside the holdout (never the trained draft's `calibrate` prompts) and disjoint.
    prompts = load_prompts(name)
    hold = {p.id for p in split_prompts(prompts, "holdout")}
    trace = {p.id for p in split_prompts(prompts, "trace")}
    test = {p.id for p in split_prompts(prompts, "test")}
    assert trace and test and not trace & test
    assert trace | test == hold
    assert 0.3 < len(trace) / len(hold) < 0.7


def test_split_known_members() -> None:
    # Pins the hash so a change in the split rule (which would silently mix calibration and
    # validation prompts across versions) fails here.
    hold = [p.id for p in split_prompts(load_prompts("mtbench"), "holdout", seed=0)]
    assert hold[:3] == PINNED_MTBENCH_HOLDOUT


PINNED_MTBENCH_HOLDOUT = ["mtbench/83", "mtbench/87", "mtbench/88"]


def test_split_fraction_bounds() -> None:
    prompts = load_prompts("alpaca")
    assert split_prompts(prompts, "holdout", holdout_frac=0.0) == []
    assert len(split_prompts(prompts, "holdout", holdout_frac=1.0)) == len(prompts)
    assert 0.4 < len(split_prompts(prompts, "holdout")) / len(prompts) < 0.6
    with pytest.raises(ValueError):
        split_prompts(prompts, "train")


def test_select_deterministic_and_prefix_stable() -> None:
    prompts = load_prompts("humaneval")
    a = [p.id for p in select(prompts, 10, seed=3)]
    assert a == [p.id for p in select(prompts[::-1], 10, seed=3)]  # independent of input order
    assert a == [p.id for p in select(prompts, 20, seed=3)][:10]
    assert a != [p.id for p in prompts[:10]]  # actually shuffled
    assert a != [p.id for p in select(prompts, 10, seed=4)]
    assert len(select(prompts, 1000)) == len(prompts)
    with pytest.raises(ValueError):
        select(prompts, 0)


def test_workload_prompts_pipeline() -> None:
    hold = workload_prompts("mtbench", 5, split="holdout", seed=0)
    assert len(hold) == 5
    assert {p.id for p in hold} <= {p.id for p in split_prompts(load_prompts("mtbench"), "holdout")}


def test_missing_file_error(tmp_path) -> None:
    with pytest.raises(WorkloadError) as e:
        load_prompts("mtbench", data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "mtbench.jsonl") in msg and "python scripts/extract_workloads.py" in msg
    with pytest.raises(WorkloadError, match="unknown workload"):
        load_prompts("gsm8k")


def test_malformed_file_error(tmp_path) -> None:
    (tmp_path / "alpaca.jsonl").write_text('{"id": "x"}\n', encoding="utf-8")
    with pytest.raises(WorkloadError, match=r"alpaca\.jsonl:1"):
        load_prompts("alpaca", data_dir=tmp_path)


class FakeTokenizer:
    def __init__(self) -> None:
        self.calls: list[tuple[list[dict[str, str]], bool]] = []

    def apply_chat_template(self, messages, add_generation_prompt=False):
        self.calls.append((messages, add_generation_prompt))
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_render() -> None:
    code = Prompt("c", "code", "def f():\n", ["def f():\n"], None)
    chat = Prompt("m", "chat", "hi", ["hi", "more"], "writing")
    tok = FakeTokenizer()
    assert render(code, tok) == "def f():\n"  # completion style, no template
    assert render(chat) == "hi"
    assert render(chat, tok, chat_template=False) == "hi"
    assert render(chat, tok) == "<user>hi<assistant>"
    assert tok.calls[-1][1] is True  # add_generation_prompt
    assert render(chat, tok, replies=["ok"]) == "<user>hi<assistant>ok<user>more<assistant>"
    with pytest.raises(ValueError):
        render(chat, tok, replies=["a", "b"])
    with pytest.raises(TypeError):
        render(chat, object())


def test_synthetic_prompt_lengths() -> None:
    assert synthetic_prompt_lengths(4, 256, seed=1) == [256] * 4
    with pytest.raises(ValueError):
        synthetic_prompt_lengths(0, 256, seed=0)
