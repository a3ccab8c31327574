"""Where the repository's files are: the one helper every package uses for repo-relative paths
(conf/, data/, models/, reports/). Presets and confs ship paths relative to the repository root,
so a relative path means the repository's file when there is one, whatever the working
directory (the bundled GGUF, which lives in an installed package, is real.model.paths')."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
DATA_DIR = ROOT / "data"
PROFILE_DIR = ROOT / "reports" / "profiles"


def repo_path(path: str | Path) -> Path:
    """``path`` with ``~`` expanded; a relative one is taken under the repository root, unless
    only the working directory has it (then as given)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    in_repo = ROOT / p
    return p if p.exists() and not in_repo.exists() else in_repo


def default_profile_path(hardware: str) -> Path:
    """The latency profile `+calibrate` writes for ``hardware=`` and `sim.cost_model=profile` reads."""
    return PROFILE_DIR / f"{hardware}.json"


def profile_path(exp: Any) -> Path:
    """``sim.profile_path`` if set, else the hardware's default profile."""
    if exp.sim.profile_path:
        return repo_path(exp.sim.profile_path)
    return default_profile_path(exp.hardware.name)


# the code a latency profile times: the kernels, the models' forwards and the speculative
# algorithms run on their outputs (sampling, Algorithm 1, trees), and how they are timed (a
# probe that finds the caches otherwise measures something else)
TIMED_CODE = ("specbed_kernels", "real/model", "testbed/spec", "real/calibrate")


@cache
def timed_code_digest() -> str:
    """A digest of the sources a latency profile's tables time (``TIMED_CODE``): a profile
    measured with other code is stale (a faster draw once left Algorithm 1 at 7x its cost in the
    profile, and predictions under load 20 % slow)."""
    h = hashlib.sha256()
    for folder in TIMED_CODE:
        for f in sorted((ROOT / folder).rglob("*")):
            if f.suffix in (".py", ".cpp") and f.is_file():
                h.update(f.relative_to(ROOT).as_posix().encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]
