"""What every setting means and its unit, read from the config dataclasses' own field docs
(``testbed.config.doc``): one source for ``--help``, the validation messages and the settings tables of the README
and docs/configuration.md; and the settings that were renamed, refused with a one-line hint."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import fields, is_dataclass

from testbed.config import ExperimentConfig

# settings renamed: the old key -> the one-line hint an old command line gets (exit code 2)
RENAMED = {"network.bandwidth_gbps": "renamed network.bandwidth_gbit_s, in gigabits per second "
           "(the old key held gigabytes per second: a 1 Gb/s link is network.bandwidth_gbit_s=1)"}


@functools.cache
def setting_docs() -> dict[str, str]:
    """Every documented setting (dotted key) -> "meaning [unit]"."""
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            if isinstance(f.default_factory, type) and is_dataclass(f.default_factory):
                walk(f.default_factory, f"{prefix}{f.name}.")
            elif "doc" in f.metadata:
                unit = f.metadata["unit"]
                out[prefix + f.name] = f.metadata["doc"] + (f" [{unit}]" if unit else "")
    walk(ExperimentConfig, "")
    return out


def renamed_setting(args: Iterable[str]) -> str | None:
    """The one-line error for the first command-line override that names a renamed setting."""
    for a in args:
        key = a.lstrip("+~").partition("=")[0]
        if key in RENAMED:
            return f"{key}: {RENAMED[key]}"
    return None


def setting_doc(key: str) -> str:
    """What setting ``key`` means, with its unit ("" for an undocumented or unknown key)."""
    return setting_docs().get(key, "")
