"""The what-if calculator `python -m sim.cost.latency`: JSON output, agreement with the roofline, errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sim.cost import latency
from sim.cost.roofline_forward import forward_cost
from sim.presets import load_hardware_preset, load_model_preset
from tests.conftest import run_cli

ARGS = ["model=llama3_70b", "hardware=h800x8", "tp=4", "tokens=8", "context=512", "quant=int4_awq"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert latency.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("extra,layers", [([], None), (["layers=10:30"], (10, 30))])
def test_json_total_equals_roofline(capsys: pytest.CaptureFixture[str], extra: list[str],
                                    layers: tuple[int, int] | None) -> None:
    d = _json(capsys, [*ARGS, "format=json", *extra])
    m = dataclasses.replace(load_model_preset("llama3_70b"), quant="int4_awq")
    r = forward_cost(m, load_hardware_preset("h800x8"), tp=4, tokens=8, context=512, layers=layers)
    assert d["total_ms"] == pytest.approx(r.total_s * 1e3, rel=1e-12)
    assert sum(d["breakdown_ms"].values()) == pytest.approx(d["total_ms"], rel=1e-9)
    assert set(d["breakdown_ms"]) == {"weights", "attention", "allreduce", "launch", "other"}
    assert d["allreduce_ms"] > 0 and d["hbm_bytes"] > 0 and d["flops"] > 0
    assert d["intensity_flop_per_byte"] == pytest.approx(d["flops"] / d["hbm_bytes"])


def test_defaults_and_preset_quant(capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, ["model=smollm2_135m", "hardware=local", "format=json"])
    assert (d["tp"], d["tokens"], d["context"], d["quant"]) == (1, 1, 0, "fp32")
    assert d["allreduce_ms"] == 0


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert latency.main(ARGS) == 0
    out = capsys.readouterr().out
    for word in ("total", "weights", "attention", "allreduce", "launch", "other", "HBM bytes",
                 "FLOPs", "arithmetic intensity"):
        assert word in out


BAD = [(["model=nosuch", "hardware=h800x8"], "model='nosuch'"),
       (["model=llama3_70b", "hardware=nosuch"], "hardware='nosuch'"),
       (["model=llama3_70b", "hardware=h800x8", "quant=int3"], "quant='int3'"),
       (["model=llama3_70b", "hardware=h800x8", "tp=16"], "tp=16"),
       (["model=llama3_70b", "hardware=a800_nodes", "tp=2"], "tp=2"),
       (["model=llama3_70b", "hardware=h800x8", "tp=two"], "tp='two'"),
       (["model=llama3_70b", "hardware=h800x8", "tokens=0"], "tokens=0"),
       (["model=llama3_70b", "hardware=h800x8", "context=-1"], "context=-1"),
       (["model=llama3_70b", "hardware=h800x8", "context=8192"], "context=8192"),
       (["model=llama3_70b", "hardware=h800x8", "layers=50:20"], "layers='50:20'"),
       (["model=llama3_70b", "hardware=h800x8", "format=xml"], "format='xml'"),
       (["model=llama3_70b", "hardware=h800x8", "gpus=4"], "gpus='4'"),
       (["model=llama3_70b"], "hardware=''")]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                         needle: str) -> None:
    assert latency.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert "allowed" in err


def test_module_entry_point() -> None:
    ok = run_cli(*ARGS, "format=json", module="sim.cost.latency", timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "total_ms" in json.loads(ok.stdout.strip().splitlines()[-1])
    bad = run_cli("model=llama3_70b", "hardware=h800x8", "tp=9", module="sim.cost.latency", timeout=120)
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert latency.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m sim.cost.latency model=" in out and "llama3_70b" in out and "h800x8" in out
