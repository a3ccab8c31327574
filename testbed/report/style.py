"""One look for every report: colours, human names, number format, figure sizes.

The same span kind and the same schedule get the same colour in every figure (one mapping,
here); column names are what a researcher reads (`tokens/s`, not `tokens_per_s`); numbers have
three significant figures; a figure is sized for its content and wrapped into rows rather than
stretched into a strip.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

# Okabe–Ito (colour-blind safe), then greys for the rest
_PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442",
            "#000000", "#999999", "#666666"]


class _ScheduleColors(Mapping[str, str]):
    """Each schedule's colour as its declaration gives it (``ScheduleSpec.color``, plug-ins
    included), and ``ar baseline`` in the baseline's."""

    def _table(self) -> dict[str, str]:
        from testbed.schedules import BASELINE, spec, specs

        colors = {s.name: s.color for s in specs()}
        return {**colors, f"{BASELINE} baseline": spec(BASELINE).color}

    def __getitem__(self, name: str) -> str:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


SCHEDULE_COLORS: Mapping[str, str] = _ScheduleColors()
# the GPU split's bars: predicted (sim) and measured (real)
PREDICTED_COLOR, MEASURED_COLOR = "#000000", "#E69F00"
SPAN_COLORS = {"draft": "#E69F00", "target": "#0072B2", "verify": "#0072B2", "prefill": "#CCCCCC",
               "link": "#009E73", "send": "#009E73", "recv": "#56B4E9", "allreduce": "#CC79A7",
               "stage": "#0072B2", "bubble": "#F0E442", "idle": "#EEEEEE",
               "select": "#D55E00", "reroot": "#D55E00"}

HUMAN = {
    "tokens_per_s": "tokens/s", "tpot_ms": "TPOT (ms)", "speedup": "speedup vs ar",
    "alpha": "α (measured)", "alpha_config": "α (set)", "mean_accepted_len": "accepted len",
    "prefill_s": "prefill (s)", "ar_tokens_per_s": "ar tokens/s", "target_gpus": "target GPUs",
    "draft_gpus": "draft GPUs", "gamma": "γ", "sim_c": "c (draft/target cost)",
    "cost_model": "cost model", "oracle": "acceptance", "latency_ms": "link latency (ms)",
    "tau": "τ", "key_token_fraction": "key-token share", "t0_ms": "t0 (ms)", "t1_ms": "t1 (ms)",
    "comm_reduction_eq5": "comm. reduction (eq. 5)", "temperature": "temperature",
    "error_pct": "error (%)", "num_requests": "requests",
    "pass_at_1": "pass@1", "pass_at_1_baseline": "pass@1 ar",
    "tree_shape": "tree (w, bs, d)",
    # validation tables: errors in %, |error| written "abs." (a pipe would end a markdown cell)
    "median_abs_error_pct": "median abs. error %", "p90_abs_error_pct": "P90 abs. error %",
    "worst_abs_error_pct": "worst abs. error %", "mean_error_pct": "mean signed error %",
    "inside_pct": "inside interval %",
    "standalone_median_abs_pct": "standalone: median abs. error %",
    "own_acceptance_median_abs_pct": "own acceptance: median abs. error %",
    "own_acceptance_mean_signed_pct": "own acceptance: mean signed error %",
    "own_acceptance_worst_abs_pct": "own acceptance: worst abs. error %",
    "standalone_error_pct": "standalone error %", "rescaled_error_pct": "rescaled error %",
    "own_acceptance_error_pct": "own acceptance error %",
    "throughput_tok_s_standalone_median_abs_pct": "throughput standalone: median abs. error %",
    "throughput_tok_s_own_median_abs_pct": "throughput own acceptance: median abs. error %",
    "tpot_ms_p50_standalone_median_abs_pct": "P50 TPOT standalone: median abs. error %",
    "tpot_ms_p50_own_median_abs_pct": "P50 TPOT own acceptance: median abs. error %",
    "dsd_point": "DSD point", "load_point": "load", "mean_accepted_len err %": "accepted len err %",
    "tokens_per_s err %": "tokens/s err %", "tpot_ms err %": "TPOT err %",
}


def human(name: str) -> str:
    """What a reader calls a field: `tokens/s`, not `tokens_per_s`; an unlisted `…_pct` field
    spelled out (`transfer_pct` → `transfer %`: a raw field name neither wraps nor reads well)."""
    if name in HUMAN:
        return HUMAN[name]
    if name.endswith("_pct") and " " not in name:
        return name[:-4].replace("_", " ") + " %"
    return name


def device_word(hardware: object) -> str:
    """What a placement counts on this hardware: a device of `hardware=local` is a CPU core."""
    return "cores" if str(hardware) == "local" else "GPUs"


def human_columns(cols: list[Any]) -> list[str]:
    return [human(str(c)) for c in cols]


def sig3(v: float) -> str:
    """Three significant figures, thousands separated, no scientific notation in normal ranges."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    mag = math.floor(math.log10(abs(v)))
    if mag >= 3:
        return f"{v:,.0f}"
    if mag < -4:
        return f"{v:.2e}"
    return f"{v:.{max(0, 2 - mag)}f}"


def color_for(name: str, fallback_index: int = 0) -> str:
    if name in SCHEDULE_COLORS:
        return SCHEDULE_COLORS[name]
    for key, c in SPAN_COLORS.items():
        if name == key or name.startswith(key):
            return c
    return _PALETTE[fallback_index % len(_PALETTE)]


def colors_for(names: list[str]) -> dict[str, str]:
    return {n: color_for(n, i) for i, n in enumerate(names)}


def grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    """Rows and columns for n facets: at most `max_cols` wide, wrapping into rows."""
    cols = min(max_cols, max(1, n))
    return math.ceil(n / cols), cols


def legend_outside(ax: Any, fontsize: int = 7, **kwargs: Any) -> None:
    """The axes' legend (one entry per label) to the right of its plot, where it covers no bar or
    line; ``fig.tight_layout()`` then makes room for it inside the figure."""
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0, fontsize=fontsize, **kwargs)


def savefig(fig: Any, path: Any) -> None:
    """Every figure the same way: 100 dpi, natural size figsize × 100 px. Every figure has been
    laid out by ``fig.tight_layout()`` with its legends inside its axes, so no ``bbox_inches=
    "tight"``: that draws the figure twice (once to measure), ~10 % of a report's drawing.
    For the same reason the placeholder layout engine ``tight_layout`` leaves behind is
    dropped: with any engine set, savefig draws the figure once more before printing it."""
    from matplotlib.layout_engine import PlaceHolderLayoutEngine

    if isinstance(fig.get_layout_engine(), PlaceHolderLayoutEngine):
        fig.set_layout_engine(None)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


_SCIPY_PARTS = ("scipy.stats", "scipy.cluster")  # what seaborn imports only to offer, if present


def seaborn() -> Any:
    """seaborn, imported without scipy. When scipy is installed, seaborn imports scipy.stats and
    scipy.cluster at import time (0.85 of its 0.9 s here) for KDEs and clustermaps, which no
    report draws; without them it uses its own bundled KDE, its documented fallback. That import
    was on the critical path of every joblib sweep (the fork server) and of every report worker.
    scipy stays importable for everything else: the parts are hidden only during the import."""
    import sys

    if "seaborn" in sys.modules:
        return sys.modules["seaborn"]
    hidden = [m for m in _SCIPY_PARTS if m not in sys.modules]
    for m in hidden:
        sys.modules[m] = None  # type: ignore[assignment]  # makes `import m` raise ImportError
    try:
        import seaborn as sns
    finally:
        for m in hidden:
            if sys.modules.get(m, 0) is None:
                del sys.modules[m]
    return sns
