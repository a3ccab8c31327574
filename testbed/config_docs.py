"""The settings that were renamed, refused with a one-line hint. (What every setting means and
its unit is read from the config dataclasses' own field docs: ``testbed.config.setting_docs``.)"""

from __future__ import annotations

from collections.abc import Iterable

# settings renamed: the old key -> the one-line hint an old command line gets (exit code 2)
RENAMED = {"network.bandwidth_gbps": "renamed network.bandwidth_gbit_s, in gigabits per second "
           "(the old key held gigabytes per second: a 1 Gb/s link is network.bandwidth_gbit_s=1)"}


def renamed_setting(args: Iterable[str]) -> str | None:
    """The one-line error for the first command-line override that names a renamed setting."""
    for a in args:
        key = a.lstrip("+~").partition("=")[0]
        if key in RENAMED:
            return f"{key}: {RENAMED[key]}"
    return None
