"""Bad values stop before the run: one line naming key, value and what is allowed; exit 2."""

from __future__ import annotations

import pytest

from testbed.app.preflight import PreflightError, preflight
from tests.conftest import run_cli

BAD = [
    (["schedule.gamma=0"], "schedule.gamma=0"),
    (["acceptance.alpha=1.5"], "acceptance.alpha=1.5"),
    (["placement.target_gpus=9"], "placement.target_gpus=9"),
    (["schedule=async", "placement.target_gpus=6", "placement.draft_gpus=3"], "placement.draft_gpus=3"),
    (["pair=llama3_70b+nosuchmodel"], "pair=llama3_70b+nosuchmodel"),
    (["pair=whatever"], "pair=whatever"),
    (["hardware=h900x8"], "hardware=h900x8"),
    (["schedule.gammma=3"], "schedule.gammma"),
    (["schedule.gamma=abc"], "schedule.gamma"),
    (["sampling.top_p=0"], "sampling.top_p=0"),
    (["network.latency_ms=-5"], "network.latency_ms=-5"),
    (["pair=llama3_70b+qwen2_1_5b"], "pair.draft.tokenizer"),
    (["+sweep=gamma", "schedule.gamma=0,3"], "schedule.gamma=0"),
    (["schedule.gamma=2,3"], "--multirun"),
    (["lookahead.by_batch=1:4"], "lookahead.by_batch"),  # read by lookahead=batch only
    (["lookahead=batch", "lookahead.by_batch=4:2 2:4"], "lookahead.by_batch"),  # not ascending
    (["lookahead=batch", "lookahead.by_batch=1-4"], "lookahead.by_batch"),
    (["lookahead=batch", "schedule.tree=true"], "lookahead='batch'"),  # the sync chain's rounds only
]


@pytest.mark.parametrize("overrides,needle", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_value_is_one_clear_line(overrides: list[str], needle: str) -> None:
    with pytest.raises(PreflightError) as e:
        preflight(overrides)
    msg = str(e.value)
    assert needle in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("overrides", [[], ["schedule=ar"], ["schedule=async", "placement.target_gpus=6",
                                                              "placement.draft_gpus=2"],
                                       ["pair=llama3_8b+llama3_2_1b", "hardware=h100x8"]])
def test_good_values_pass(overrides: list[str]) -> None:
    preflight(overrides)


def test_cli_exit_code_and_no_traceback() -> None:
    p = run_cli("schedule.gamma=0", "hydra.run.dir=/tmp/should_not_exist_testbed")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "schedule.gamma=0" in lines[0], p.stderr
