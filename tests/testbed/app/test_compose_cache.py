"""The pre-run check's shared config cache (testbed/app/compose_cache.py) composes exactly what Hydra
composes without it, for every job of the shipped sweeps."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.app import preflight
from testbed.app.compose_cache import shared_config_cache
from testbed.paths import CONF_DIR

SWEEPS = sorted(p.stem for p in (CONF_DIR / "sweep").glob("*.yaml"))


def _container(cfg):  # type: ignore[no-untyped-def]
    return OmegaConf.to_container(cfg, resolve=False)


@pytest.mark.parametrize(("backend", "sweeps"), [
    ("sim", ["gpu_split", "wan"]),  # 27 group combinations composed from one cache
    pytest.param("sim", SWEEPS, marks=pytest.mark.slow),  # every shipped sweep, both backends
    pytest.param("real", SWEEPS, marks=pytest.mark.slow),
])
def test_cached_compositions_equal_hydras_own(backend: str, sweeps: list[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    composed: list[tuple[list[str], object]] = []
    real_compose = preflight._compose

    def recording(overrides: list[str]):  # type: ignore[no-untyped-def]
        cfg = real_compose(overrides)
        composed.append((list(overrides), _container(cfg)))
        return cfg

    monkeypatch.setattr(preflight, "_compose", recording)
    checked = 0
    for sweep in sweeps:
        before = len(composed)
        try:
            preflight.preflight([f"+sweep={sweep}", f"backend={backend}"])
        except preflight.PreflightError:
            continue  # (a sweep without a grid for this backend)
        checked += len(composed) - before > 1  # a sweep that composed from the cache
    assert checked >= 1 and len(composed) > 20
    # the same compositions, each by Hydra alone in a fresh context (no shared cache)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for overrides, cached in composed:
            fresh = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            assert _container(fresh) == cached, overrides


def test_the_cache_is_hydras_again_after_the_check() -> None:
    from hydra._internal import config_loader_impl
    from hydra._internal.config_repository import CachingConfigRepository

    with shared_config_cache():
        assert config_loader_impl.CachingConfigRepository is not CachingConfigRepository
        with shared_config_cache():  # nested: the outer cache stays
            pass
        assert config_loader_impl.CachingConfigRepository is not CachingConfigRepository
    assert config_loader_impl.CachingConfigRepository is CachingConfigRepository


def test_a_config_file_changed_between_checks_is_read_again(tmp_path: Path) -> None:
    """The cache lives for one check: a later check sees the file as it is now."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text("a: 1\n")
    for value in (1, 2):
        (conf / "config.yaml").write_text(f"a: {value}\n")
        with initialize_config_dir(config_dir=str(conf), version_base=None), shared_config_cache():
            assert compose(config_name="config").a == value
            assert compose(config_name="config").a == value
