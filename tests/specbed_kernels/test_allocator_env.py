"""torch's CPU allocator is asked for transparent huge pages before torch loads (testbed/__init__):
every entry package sets it, and a user's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed.paths import repo_path


@pytest.mark.parametrize("package", ["testbed", "real", "specbed_kernels"])
def test_entry_packages_ask_for_huge_pages_unless_the_user_said_otherwise(package: str) -> None:
    code = (f"import {package}, os, sys; print(os.environ.get('THP_MEM_ALLOC_ENABLE')); "
            "print('torch' in sys.modules)")
    for preset, want in ((None, "1"), ("0", "0")):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        if preset is not None:
            env["THP_MEM_ALLOC_ENABLE"] = preset
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo_path("."),
                             capture_output=True, text=True, check=True).stdout.split()
        assert out[0] == want
    if package == "testbed":  # set before torch is imported: it reads it at its first allocation
        assert out[1] == "False"
