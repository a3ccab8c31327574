"""conf/model and conf/hardware presets: they load, validate and match published figures."""

from __future__ import annotations

import pytest

from sim.cost.quant import bytes_per_weight
from sim.presets import load_hardware_preset, load_model_preset, preset_names
from testbed.config import ConfigError, ExperimentConfig, PairConfig
from testbed.config_validate import validate

# Published parameter counts (model cards); GPTBigCode's learned position table and biases are
# not in ModelConfig.params, hence the 5% tolerance.
PARAMS = {"llama3_2_1b": 1.24e9, "llama3_2_3b": 3.21e9, "llama3_8b": 8.03e9, "llama3_70b": 70.6e9,
          "qwen2_1_5b": 1.54e9, "qwen2_72b": 72.7e9, "deepseek_coder_1_3b": 1.35e9,
          "deepseek_coder_33b": 33.3e9, "vicuna_68m": 68e6, "vicuna_13b": 13.0e9,
          "tiny_starcoder_168m": 164e6, "starcoder_15b": 15.5e9, "smollm2_135m": 134.5e6}
HARDWARE = ["h100x8", "h800x8", "h200x8", "a100x8", "a800x8", "a800_nodes", "local"]


def test_every_named_preset_exists() -> None:
    assert set(preset_names("model")) >= set(PARAMS)
    assert set(preset_names("hardware")) >= set(HARDWARE)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_model_preset_loads_validates_and_matches_published_size(name: str) -> None:
    m = load_model_preset(name)
    assert m.name == name and m.tokenizer
    validate(ExperimentConfig(pair=PairConfig(target=m, draft=m)))
    assert m.params == pytest.approx(PARAMS[name], rel=0.05)


def test_starcoder_is_mqa_with_gelu_mlp() -> None:
    for name in ("starcoder_15b", "tiny_starcoder_168m"):
        m = load_model_preset(name)
        assert (m.kv_heads, m.mlp, m.tokenizer) == (1, "gelu", "starcoder")


@pytest.mark.parametrize("name", HARDWARE)
def test_hardware_preset(name: str) -> None:
    hw = load_hardware_preset(name)
    assert hw.name == name
    assert set(hw.gpu.tflops) == {"fp32", "tf32", "bf16", "fp16", "int8"}
    assert all(v > 0 for v in hw.gpu.tflops.values()) and hw.gpu.hbm_gbps > 0
    if hw.gpus_per_node > 1:
        assert hw.nvlink_gbps > 0 and hw.allreduce_alpha_us > 0


def test_a800_nodes_is_dsd_cluster() -> None:
    hw = load_hardware_preset("a800_nodes")
    assert (hw.gpus_per_node, hw.nodes, hw.nic_gbps) == (1, 8, 12.5)


def test_unknown_preset_names_key_and_choices() -> None:
    with pytest.raises(ConfigError, match="model='nosuch'.*llama3_70b"):
        load_model_preset("nosuch")
    with pytest.raises(ConfigError, match="hardware='../x'"):
        load_hardware_preset("../x")


def test_bytes_per_weight() -> None:
    assert bytes_per_weight("fp32") == 4 and bytes_per_weight("bf16") == 2
    assert bytes_per_weight("int4_awq", 4096) == pytest.approx(0.5 + 4 / 128)
    assert bytes_per_weight("q4_1", 4096) == pytest.approx(20 / 32)
    assert 1 < bytes_per_weight("int8", 4096) < 1.01
