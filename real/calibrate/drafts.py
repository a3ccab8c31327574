"""Which drafts a calibration measures, and how it builds them: the pair's draft first, then
every preset that can draft for the target here; and the sampling classes it times them at.
Shared by the profile's tables (real/calibrate/profile.py, real/calibrate/tree.py) and the run probe
(real/calibrate/probe_forward.py)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from testbed.config import ExperimentConfig, ModelConfig
from testbed.paths import CONF_DIR, repo_path

TEMPERATURES = {"greedy": 0.0, "sample": 1.0}


def _draft_presets(target: ModelConfig) -> list[ModelConfig]:
    """Every model preset that can draft for `target` on this machine."""
    from omegaconf import OmegaConf

    conf = CONF_DIR / "model"
    out = []
    for f in sorted(conf.glob("*.yaml")):
        m = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(f)))
        assert isinstance(m, ModelConfig)
        if m.name == target.name:
            continue
        if m.kind == "ngram":
            out.append(m)
        elif m.kind == "early_exit":
            if 1 <= m.exit_layer < target.layers and (m.tokenizer or target.tokenizer) == target.tokenizer:
                out.append(m)
        elif m.tokenizer and m.tokenizer == target.tokenizer and m.path and repo_path(m.path).exists():
            out.append(m)
    return out


def drafts_to_measure(exp: ExperimentConfig) -> list[ModelConfig]:
    """The pair's draft first (when it can run here), then every other available draft."""
    found = {m.name: m for m in _draft_presets(exp.pair.target)}
    d = exp.pair.draft
    runnable = d.kind not in ("transformer", "eagle") or (d.path is not None and repo_path(d.path).exists())
    if d.name and d.name not in found and runnable:
        found = {d.name: d, **found}
    return list(found.values())


def make_draft(exp: ExperimentConfig, draft: ModelConfig, target: Any, tokenizer: Any, *, params: Any) -> Any:
    from real.runtime import loading

    e = copy.deepcopy(exp)
    e.pair.draft = draft
    e.schedule.name = "sync"
    n_args = len(inspect.signature(loading.make_draft).parameters)
    args = (e, target, tokenizer, params)[:n_args]
    return loading.make_draft(*args)


def picker(greedy: bool, gen: Any) -> Callable[[Any], int]:
    """A draft's next guess from its distribution ``q``, as ``ChainWindow.take`` picks it: the
    argmax at temperature 0, else a draw (``testbed.spec.sampling.sample``)."""
    from testbed.spec.sampling import sample

    if greedy:
        return lambda q: int(q.argmax())
    return lambda q: sample(q, gen)
