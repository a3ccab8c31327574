"""Load the model and hardware presets in conf/ as plain dataclasses (no Hydra needed).

``load_model_preset("llama3_70b")`` reads conf/model/llama3_70b.yaml, merges it into the
structured ``ModelConfig`` (so types are checked and missing fields take their defaults) and
returns the dataclass. Unknown names raise ``ConfigError`` naming the key and the allowed names.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from testbed.config import ConfigError, HardwareConfig, ModelConfig
from testbed.paths import CONF_DIR


def preset_names(group: str) -> list[str]:
    """File stems of conf/<group>/*.yaml, sorted."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _load(group: str, schema: type, name: str, key: str) -> Any:
    path = CONF_DIR / group / f"{name}.yaml"
    if not name or "/" in name or not path.is_file():
        raise ConfigError(key, name, "one of " + ", ".join(preset_names(group)))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # a malformed preset file: say which one
        raise ConfigError(key, name, f"a valid {schema.__name__} in {path} ({e})") from None
    assert isinstance(obj, schema)
    return obj


def load_model_preset(name: str, key: str = "model") -> ModelConfig:
    return _load("model", ModelConfig, name, key)


def load_hardware_preset(name: str, key: str = "hardware") -> HardwareConfig:
    return _load("hardware", HardwareConfig, name, key)
