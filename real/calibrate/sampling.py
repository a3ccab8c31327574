"""Sampling cost per distribution and mode, for the latency profile (real/calibrate/profile.py).

Every draft token and every verified position turns logits into a standardized distribution
(testbed.spec.sampling.standardize). The profile's forward tables already include it for the
temperature class they were measured at (greedy: argmax; sample: T=1, a softmax), but not the
extra work of top-k and top-p. Here ``standardize`` is timed per mode (testbed.spec.sampling.
SAMPLING_MODES) on real next-token logits of each model (top-p's cost depends on how flat they
are), and stored per model as

    "sampling": {"vocab": V, "params": {"temperature": T, "top_k": K, "top_p": P},
                 "seconds": {mode: seconds per distribution}, "raw": {mode: [per pass]}}

``sim.cost.profile`` charges ``seconds[mode] - seconds[the class's own mode]`` per draft
token and per verified distribution. Profiles without the node stay readable (no extra charged).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from testbed.spec.sampling import SamplingParams, standardize

DEFAULT_TOP_K, DEFAULT_TOP_P, SAMPLE_TEMPERATURE = 50, 0.9, 1.0
PROMPT_TOKENS = 128  # logits of a real prompt's last positions; a longer prefill adds nothing


def mode_params(temperature: float = SAMPLE_TEMPERATURE, top_k: int = DEFAULT_TOP_K,
                top_p: float = DEFAULT_TOP_P) -> dict[str, SamplingParams]:
    """The parameters timed for each mode (the experiment's own where it sets them)."""
    return {"greedy": SamplingParams(0.0),
            "temperature": SamplingParams(temperature),
            "top_k": SamplingParams(temperature, top_k=top_k),
            "top_p": SamplingParams(temperature, top_p=top_p),
            "top_k_top_p": SamplingParams(temperature, top_k=top_k, top_p=top_p)}


def time_modes(logits: torch.Tensor, params: dict[str, SamplingParams], passes: int = 5
               ) -> dict[str, Any]:
    """Median over `passes` of the mean seconds per distribution (one row at a time, as the
    schedules call it), the modes interleaved within each pass so drift hits them alike."""
    raw: dict[str, list[float]] = {m: [] for m in params}
    for _ in range(passes):
        for mode, p in params.items():
            start = time.perf_counter()
            for row in logits:
                standardize(row, p)
            raw[mode].append((time.perf_counter() - start) / len(logits))
    return {"seconds": {m: statistics.median(v) for m, v in raw.items()}, "raw": raw}


def prompt_logits(model: Any, ids: list[int], rows: int) -> torch.Tensor:
    """The last `rows` next-token logits of `model` (a real.model.decoder Transformer) over `ids`."""
    ids = ids[: max(rows, min(len(ids), model.max_seq - 1, PROMPT_TOKENS))]
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), input_pos=0)[0]
    return logits[-rows:].float().clone()


def measure_sampling(logits: torch.Tensor, temperature: float = SAMPLE_TEMPERATURE,
                     *, top_k: int = DEFAULT_TOP_K, top_p: float = DEFAULT_TOP_P,
                     passes: int = 5) -> dict[str, Any]:
    """The profile's "sampling" node for one model from its logits [rows, V]."""
    out = time_modes(logits, mode_params(temperature, top_k, top_p), passes)
    return {"vocab": int(logits.shape[-1]), "rows": int(logits.shape[0]), "passes": passes,
            "params": {"temperature": temperature, "top_k": top_k, "top_p": top_p}, **out}


def add_sampling_tables(exp: Any, target: Any, *, prompt: list[int], models: dict[str, Any],
                        drafts: list[Any], log: Any = print, rows: int = 8, passes: int = 5) -> None:
    """Add the "sampling" node to the target's and every transformer draft's entry of `models`
    (an early-exit draft shares the target's LM head and vocabulary: the target's logits; an
    n-gram draft's q is one-hot: nothing to standardize)."""
    from real.model.weights import load_model
    from testbed.paths import repo_path

    sp = exp.sampling
    kw = {"temperature": sp.temperature or SAMPLE_TEMPERATURE,
          "top_k": sp.top_k or DEFAULT_TOP_K, "top_p": sp.top_p if sp.top_p < 1.0 else DEFAULT_TOP_P}
    target_logits = prompt_logits(target, prompt, rows)
    by_name = {d.name: d for d in drafts}
    for name, entry in models.items():
        if entry.get("kind") == "ngram" or "forward" not in entry:
            continue
        logits = target_logits
        d = by_name.get(name)
        if entry.get("role") == "draft" and entry.get("kind") == "transformer" and d is not None and d.path:
            try:
                model, _ = load_model(repo_path(d.path), max_seq=max(64, rows + 1))
                logits = prompt_logits(model, prompt, rows)
            except Exception as e:  # noqa: BLE001 - the target's vocabulary is the same
                log(f"sampling {name}: the target's logits ({type(e).__name__}: {e})")
        entry["sampling"] = measure_sampling(logits, passes=passes, **kw)
        cells = " ".join(f"{m}={1e3 * v:.3f}" for m, v in entry["sampling"]["seconds"].items())
        log(f"{name} sampling per distribution (ms): {cells}")
