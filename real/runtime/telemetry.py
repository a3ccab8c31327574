"""Telemetry of a real run, sampled in a background thread: NVML (nvidia-ml-py) when a GPU is
used, CPU utilisation and resident memory (psutil) always. Written as telemetry.parquet, its
summary in run_info.json (``run_files``): every real run writes both, whatever its schedule."""

from __future__ import annotations

import threading
import time
from typing import Any

import pandas as pd
import psutil


def _nvml_handle(pynvml, device: str):  # noqa: ANN001, ANN202
    """NVML's handle of the GPU this process runs on: ``cuda:N``, or plain ``cuda`` = the current
    device (a worker made its own GPU current). Matched by UUID, since NVML numbers every GPU
    of the machine while CUDA numbers the visible ones."""
    import torch

    index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # noqa: BLE001 - an older torch or driver: by index
        return pynvml.nvmlDeviceGetHandleByIndex(index)


class Telemetry:
    def __init__(self, device: str = "cpu", interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = psutil.Process()
        self._nvml = None
        if device.startswith("cuda"):
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = (pynvml, _nvml_handle(pynvml, device))
            except Exception:  # noqa: BLE001 - no driver / no GPU: CPU telemetry only
                self._nvml = None

    def sample(self, t: float) -> dict[str, Any]:
        row: dict[str, Any] = {"t_s": t, "cpu_percent": psutil.cpu_percent(None),
                               "process_cpu_percent": self._proc.cpu_percent(None),
                               "rss_mb": self._proc.memory_info().rss / 2**20}
        if self._nvml is not None:
            nv, h = self._nvml
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            row.update(gpu_util_percent=util.gpu, gpu_mem_used_mb=mem.used / 2**20,
                       gpu_power_w=nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        return row

    def _loop(self, t0: float) -> None:
        while not self._stop.wait(self.interval_s):
            self.rows.append(self.sample(time.perf_counter() - t0))

    def __enter__(self) -> Telemetry:
        psutil.cpu_percent(None)
        self._proc.cpu_percent(None)  # prime: the first call returns 0
        t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, args=(t0,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["t_s", "cpu_percent", "process_cpu_percent", "rss_mb"]
                            if not self.rows else None)

    def summary(self) -> dict[str, float | None]:
        df = self.frame()
        if df.empty:
            return {"samples": 0}
        out = {"samples": len(df), "cpu_percent_mean": float(df.cpu_percent.mean()),
               "rss_mb_max": float(df.rss_mb.max())}
        if "gpu_util_percent" in df:
            out["gpu_util_percent_mean"] = float(df.gpu_util_percent.mean())
        return out


def run_files(frame: pd.DataFrame | None, summary: dict | None) -> dict[str, Any]:
    """A run's files from the telemetry its sampling rank sent back (RunResult.artifacts)."""
    frame = Telemetry().frame() if frame is None else frame  # (no samples: the empty table)
    return {"telemetry.parquet": frame, "run_info.json": {"telemetry": summary or {"samples": 0}}}
