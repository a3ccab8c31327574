"""What a latency profile records of the machine it was measured on (``machine`` in
profile.json): the CPU, the cores, the memory, the load when it ran."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def machine_facts() -> dict[str, Any]:
    import psutil

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    freq = psutil.cpu_freq()
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": model,
            "python": platform.python_version(), "cpus_logical": psutil.cpu_count(),
            "cpus_physical": psutil.cpu_count(logical=False),
            "cpu_mhz": freq.current if freq else None,
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 2),
            "hostname": platform.node()}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
