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
