"""testbed.registry.Registry: entries by name, declared ones imported on first use, a loader
for names found on demand, and one-line errors that suggest the closest name."""

from __future__ import annotations

import pytest

from testbed.registry import Registry, UnknownName


def test_registry_declares_lazily_registers_and_suggests() -> None:
    reg: Registry[int] = Registry("widget")
    reg.register("one", 1)

    @reg.register("two")
    def two() -> int:
        return 2

    reg.declare("json", "json")  # imported on first get; it registers nothing here
    assert reg.names() == ("one", "two", "json") and "json" in reg and len(reg) == 3
    assert reg.get("one") == 1 and reg.get("two") is two and reg.loaded() == [1, two]
    with pytest.raises(UnknownName) as e:
        reg.get("too")
    assert str(e.value) == "widget 'too' is not known: one of one, two, json; did you mean two?"
    assert isinstance(e.value, KeyError) and reg.find("too") is None
    with pytest.raises(UnknownName, match="json did not register it"):
        reg.get("json")


def test_registry_loader_finds_names_on_demand() -> None:
    asked = []
    reg: Registry[str] = Registry("thing", loader=lambda name: (asked.append(name), reg.register(name, name.upper())))
    assert reg.get("abc") == "ABC" and asked == ["abc"] and reg.names() == ("abc",)


def test_the_name_lists_of_the_settings_come_from_their_registries() -> None:
    """Every choice the validation allows is a registry's name: acceptance oracles and cost
    models (the simulator's), lookahead policies, model kinds (each one a real draft factory),
    backends; the conf groups offer exactly those."""
    from real.runtime.loading import DRAFTS
    from testbed import backends
    from testbed.config import MODEL_KINDS
    from testbed.paths import CONF_DIR
    from testbed.spec.lookahead import LOOKAHEADS

    def conf(group: str) -> set[str]:
        return {p.stem for p in (CONF_DIR / group).glob("*.yaml")}

    assert backends.names() == ("sim", "real") and set(backends.names()) == conf("backend")
    assert set(backends.option_names("acceptance")) == conf("acceptance")
    assert backends.option_names("sim.cost_model") == ("analytic", "roofline", "profile")
    for name in backends.option_names("sim.cost_model"):  # each declared module registers it
        assert callable(backends.get("sim").options["sim.cost_model"].get(name))
    assert set(LOOKAHEADS.names()) == conf("lookahead")
    assert set(DRAFTS.names()) == set(MODEL_KINDS.names())
    assert backends.option_names("no.such.setting") == ()
