"""What a setting means and its unit come from one place, the config dataclasses' field docs:
`--help` shows them for every setting, validation errors quote them, and the link bandwidth's
unit is in its name (Gbit/s; the old `bandwidth_gbps` held GB/s and is refused)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from testbed.app.cli_help import GROUP_NOTES, HIDDEN_GROUPS, help_text
from testbed.app.preflight import schema_types
from testbed.compose import to_experiment
from testbed.config import ConfigError, as_dict, setting_docs
from testbed.config_docs import renamed_setting
from testbed.paths import CONF_DIR
from testbed.placement import make_placement
from tests.conftest import compose_exp

PRESETS = ("pair.", "hardware.")  # chosen as presets (pair=, hardware=), documented in conf/


def test_every_setting_has_a_meaning_and_help_shows_it() -> None:
    keys = [k for k in schema_types() if not k.startswith(PRESETS)]
    docs = setting_docs()
    assert not [k for k in keys if not docs.get(k)], "settings without a field doc"
    text = help_text()
    for key in keys:
        first = docs[key].split()[:4]
        assert " ".join(first) in " ".join(text.split()), f"--help lacks what {key} means"
    assert "+calibrate" in text and "calibrate                      bool" not in text


def test_units_are_shown_where_a_setting_has_one() -> None:
    docs = setting_docs()
    assert docs["network.bandwidth_gbit_s"].endswith("[Gbit/s (gigabits per second: 1 for a 1 Gb/s link)]")
    assert docs["network.latency_ms"].endswith("[ms]") and docs["real.recv_timeout_s"].endswith("[s]")
    assert "Gbit/s" in help_text()


def test_every_group_help_lists_has_a_description() -> None:
    text = help_text()
    for group in sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in HIDDEN_GROUPS):
        if group in ("hydra",):
            continue
        assert GROUP_NOTES.get(group), f"group {group} has no description"
        assert f"  {group:<11}{GROUP_NOTES[group]}" in text


def test_a_validation_error_says_what_the_setting_means() -> None:
    exp = compose_exp("schedule=decentralized", "network=wan")
    exp.network.latency_ms = -1.0
    from testbed.config_validate import validate

    with pytest.raises(ConfigError, match=r"network.latency_ms: one-way latency of a link between nodes \[ms\]"):
        validate(exp)


def test_the_wan_preset_is_one_gigabit_per_second() -> None:
    exp = compose_exp("schedule=decentralized", "network=wan", "placement.nodes=2")
    assert exp.network.bandwidth_gbit_s == 1.0
    links = [lk.model for lk in make_placement(exp).links if lk.emulated]
    assert links and all(m.bandwidth_Bps == pytest.approx(0.125e9) for m in links)  # bytes/s


def test_the_old_bandwidth_key_is_refused_with_the_new_name() -> None:
    msg = renamed_setting(["schedule=decentralized", "network.bandwidth_gbps=0.125"])
    assert msg and "\n" not in msg and "network.bandwidth_gbit_s" in msg and "gigabits" in msg
    assert renamed_setting(["network.bandwidth_gbit_s=1"]) is None


def test_a_run_recorded_with_the_old_key_loads_in_gigabits() -> None:
    d = as_dict(compose_exp("schedule=decentralized", "network=wan"))
    net = d["network"]
    net["bandwidth_gbps"] = net.pop("bandwidth_gbit_s") / 8  # as an older experiment.yaml holds it
    assert to_experiment(OmegaConf.create(d)).network.bandwidth_gbit_s == pytest.approx(1.0)


SETTINGS_TABLE = "| key | meaning |"
# the pages with a settings table: the README's main settings, and every setting in docs/
SETTINGS_PAGES = ("README.md", "docs/configuration.md")


def settings_tables() -> dict[str, str]:
    """Every `| key | meaning |` table of README.md and docs/*.md, by page (a page may hold
    several: each is one entry, ``page#n``)."""
    root = CONF_DIR.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    out = {}
    for page in pages:
        parts = page.read_text().split(SETTINGS_TABLE)[1:]
        for n, rest in enumerate(parts):
            out[f"{page.relative_to(root)}#{n}"] = rest.split("\n\n", 1)[0]
    return out


def table_keys(table: str) -> set[str]:
    """The settings (`group.key`) a settings table names."""
    import re

    groups = {s.split(".")[0] for s in setting_docs()}
    return {k for k in re.findall(r"`([a-z_]+\.[a-z_0-9.]+)[`=\\]", table)
            if ".." not in k and not k.startswith(PRESETS) and k.split(".")[0] in groups}


def test_the_settings_tables_name_documented_settings_only() -> None:
    """Every `| key | meaning |` table of the README and of docs/ names settings the schema
    documents (a renamed or removed key there would send a reader to a setting that is refused),
    and the README and docs/configuration.md each have one."""
    tables = settings_tables()
    for page in SETTINGS_PAGES:
        assert f"{page}#0" in tables, f"{page} has no settings table ({SETTINGS_TABLE})"
    docs = setting_docs()
    for where, table in tables.items():
        keys = table_keys(table)
        assert keys, f"no settings found in the table of {where}"
        assert sorted(k for k in keys if k not in docs) == [], where


def test_the_readme_settings_are_in_the_full_table() -> None:
    """The README's table is a summary of docs/configuration.md's: every setting it names is
    there too, so the full table stays the complete one."""
    tables = settings_tables()
    readme = set().union(*(table_keys(t) for w, t in tables.items() if w.startswith("README.md#")))
    full = set().union(*(table_keys(t) for w, t in tables.items() if w.startswith("docs/configuration.md#")))
    assert sorted(readme - full) == []


def test_the_rename_keeps_finished_sweep_jobs_done() -> None:
    """A job's hash is what it was under network.bandwidth_gbps (GB/s) and before the load
    settings (workload.arrival …, serving.*) existed: resuming a sweep finished before either
    change skips its jobs instead of running them all again."""
    import hashlib
    import json

    from testbed.app.unused_settings import experiment_hash, normalized

    exp = compose_exp("schedule=decentralized", "network=wan", "placement.nodes=2")
    old = as_dict(normalized(exp))
    old["network"] = {"name": "wan", "latency_ms": 20.0, "bandwidth_gbps": 0.125, "jitter_ms": 2.0}
    del old["serving"]
    for key in ("arrival", "concurrency", "rate", "trace_path"):
        del old["workload"][key]
    blob = json.dumps(old, sort_keys=True, default=str)
    assert experiment_hash(exp) == hashlib.sha256(blob.encode()).hexdigest()[:16]
