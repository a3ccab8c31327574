"""The profile cost model against real runs' recorded rounds (``sim.profile_rescale``): each
recorded round beside what the model charges for it, the per-role (and, for the target, per-k)
scale that fits the model to them, and a run's modelled decode time with its own acceptance.
``ProfileCost`` (sim/cost/profile.py) calls these on itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.config import ConfigError
from testbed.schedules import find

MIN_ROUNDS = 5  # rescale: rounds of one k needed for a k of its own


def recorded_rounds(cost: Any, run_dir: Path) -> list[tuple[int, int, int, float, float, float, float]]:
    """A real `sync` (or serial-tree) run's rounds with this model's times beside the
    recorded ones: (request, drafted, accepted, recorded draft s, modelled draft s, recorded
    target s, modelled target s) — contexts rebuilt from the prompt lengths as the schedule
    does. A tree round is modelled as its d expansions of w leaves (tree-shaped, over the
    prefix and half the expanded slots) and a tree-shaped verification of its batch."""
    import pandas as pd

    try:
        rounds = pd.read_parquet(run_dir / "rounds.parquet")
        requests = pd.read_parquet(run_dir / "requests.parquet", columns=["request_id", "prompt_len"])
    except Exception as e:  # pyarrow raises several kinds for a damaged file
        raise ConfigError("acceptance.trace_path", str(run_dir), "run directories with readable "
                          f"parquet files ({str(e).splitlines()[0][:100]})") from None
    plen = dict(zip(requests["request_id"], requests["prompt_len"]))
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    recorded = find(summary.get("schedule"))
    tree = recorded is not None and recorded.serial and recorded.tree  # a serial tree's rounds
    width = int(summary.get("tree_width") or 1)
    depth = int(summary.get("tree_depth_used") or summary.get("gamma") or 1)
    if "verified_tokens" not in rounds:
        rounds = rounds.assign(verified_tokens=rounds["drafted"] + 1)
    out = []
    for rid, g in rounds.sort_values(["request_id", "round"]).groupby("request_id"):
        seq_len, pending = int(plen.get(rid, 0)), 1
        for k, n, v, t_draft, t_target in zip(g["drafted"], g["accepted"], g["verified_tokens"],
                                              g["draft_s"], g["target_s"]):
            k, n, v = int(k), int(n), int(v)
            m_draft = 0.0
            if tree:
                if "draft" in cost._forward:
                    m_draft = depth * cost.forward("draft", width, seq_len + width * depth // 2,
                                                   _raw=True, shape="tree")
                m_target = cost.forward("target", v, seq_len - 1, _raw=True, shape="tree")
                seq_len += n + 1
                out.append((int(rid), k, n, float(t_draft), m_draft, float(t_target), m_target))
                continue
            if "draft" in cost._forward:  # not bound for `ar` (the baseline)
                m_draft = cost.draft_chain(pending, k, seq_len, _raw=True)
            m_target = cost.forward("target", k + 1, seq_len - 1, _raw=True)
            out.append((int(rid), k, n, float(t_draft), m_draft, float(t_target), m_target))
            seq_len += n + 1
            pending = 2 if k and n == k else 1
    return out

def fit_scale(cost: Any, run_dirs: list[Path]) -> None:
    """Recorded time / modelled time over the `sync` rounds of real runs: per role, and for
    the target also per k where at least MIN_ROUNDS rounds verified k tokens (the shape in
    context is kept; the level, and the shape in k where observed, follow the machine as it
    is now). Rounds more than 3x off the median ratio (a neighbour's burst) are left out."""
    pairs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for d in run_dirs:
        for _, k, _, t_d, m_d, t_t, m_t in recorded_rounds(cost, d):
            for key, t, m in ((("draft", -1), t_d, m_d), (("target", -1), t_t, m_t),
                              (("target", k + 1), t_t, m_t)):
                if t > 0 and m > 0:
                    pairs.setdefault(key, []).append((t, m))
    for (role, k), ps in pairs.items():
        mid = sorted(t / m for t, m in ps)[len(ps) // 2]
        kept = [(t, m) for t, m in ps if mid / 3 <= t / m <= 3 * mid]
        ratio = sum(t for t, _ in kept) / sum(m for _, m in kept)
        if k < 0:
            cost.scale[role] = ratio
        elif len(kept) >= MIN_ROUNDS:
            cost.scale_k[k] = ratio


def decode_seconds(cost: Any, run_dir: Path) -> dict[int, float]:
    """Modelled decode time per request of a recorded real run, with its own acceptance."""
    out: dict[int, float] = {}
    for rid, k, _, _, m_d, _, m_t in recorded_rounds(cost, run_dir):
        out[rid] = out.get(rid, 0.0) + m_d * cost.role_scale("draft", 1) + m_t * cost.role_scale("target", k + 1)
    return out
