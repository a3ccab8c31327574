"""A short probe of the machine's speed that does not depend on any experiment's configuration.

On a CPU host the forwards of the models are memory-bandwidth bound, and a shared VM's
bandwidth drifts (±20–30 % between runs minutes apart, 2× over an hour was seen). The latency
profile records this probe when it is measured; a prediction made later with
``sim.profile_drift=probe`` runs it again and scales the profile's times by the ratio — a
correction for the machine's drift that never looks at a run of the configuration it predicts.

The probe copies a buffer much larger than the last-level cache a few times on one thread
(what each worker of the real backend has) and reports the median copy bandwidth, reads plus
writes, in GB/s. It takes 0.1–0.3 s.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

PROBE_MB = 64  # per buffer: well above any last-level cache of the hosts we run on
# the models' probe forward (real/calibrate/probe_forward.py): one token at this KV slot, on both backends
FORWARD_PROBE_CONTEXT = 64  # the smallest context of the profile's tables
FORWARD_PROBE_TOKENS = 8  # the target's second probe (a verification's size): in-run drift by k
# the target's verification sizes at small γ, probed too: the shape in k drifts as well as the
# level (k = 3 over k = 1: 1.40 in a profile, 1.50 in runs five hours later on this host)
FORWARD_PROBE_SMALL_K = (2, 3, 4)
PROBE_REPEATS = 5


def bandwidth_probe_gbps(*, mb: int = PROBE_MB, repeats: int = PROBE_REPEATS) -> float:
    """Median single-thread copy bandwidth (bytes read + written per second), in GB/s."""
    src = np.ones(mb * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch: page faults are not bandwidth
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * src.nbytes / statistics.median(times) / 1e9


def probe_record() -> dict[str, float]:
    """What a profile or a run stores: the probe's GB/s and when it was taken (Unix time)."""
    return {"gbps": round(bandwidth_probe_gbps(), 3), "at": round(time.time(), 1)}


def forward_drift_factors(profile_forward_s: dict[str, float], now_s: dict[str, float],
                          roles: dict[str, str]) -> dict[str, float]:
    """``sim.profile_drift=forward`` (real/calibrate/probe_forward.py): a multiplier per role (``roles``:
    role -> model name) for the profile's times to hold now — the model's probe forward now
    over the same probe in the profile. A role whose model has no forward (the n-gram draft)
    takes the target's: a slower machine slows its Python too."""
    out: dict[str, float] = {}
    for role, name in roles.items():
        if name in now_s and name in profile_forward_s:
            if profile_forward_s[name] <= 0 or now_s[name] <= 0:
                raise ValueError(f"forward probe readings must be positive, got "
                                 f"{profile_forward_s[name]} and {now_s[name]} for {name}")
            out[role] = now_s[name] / profile_forward_s[name]
    if "target" not in out:
        raise KeyError(f"no forward probe of the target {roles.get('target')!r}")
    return {role: out.get(role, out["target"]) for role in roles}


def drift_factor(profile_gbps: float, now_gbps: float) -> float:
    """Multiplier for times measured at ``profile_gbps`` to hold at ``now_gbps`` (slower
    machine now -> larger times)."""
    if profile_gbps <= 0 or now_gbps <= 0:
        raise ValueError(f"bandwidth probe readings must be positive, got {profile_gbps} and {now_gbps}")
    return profile_gbps / now_gbps


PROBE_REUSE_S = 30.0  # a sweep's predictions within this many seconds share one probe
_last: tuple[float, float] | None = None  # (monotonic time, GB/s)


def probe_now() -> float:
    """The probe's GB/s, run now — or within the last ``PROBE_REUSE_S`` seconds (a sweep of
    simulated jobs would otherwise spend 0.2 s of each on it)."""
    global _last
    if _last is None or time.monotonic() - _last[0] > PROBE_REUSE_S:
        _last = (time.monotonic(), bandwidth_probe_gbps())
    return _last[1]
