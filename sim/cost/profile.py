"""`sim.cost_model=profile`: forward latency interpolated in tables measured on this machine.

`python -m testbed backend=real +calibrate` (real/calibrate/profile.py) times the real backend's own
calls — ``TargetRunner.probs`` for k = 1..32 tokens at several context lengths, each draft's
forward plus its pick of a guess (the n-gram lookup for prompt-lookup drafts), the acceptance
step (Algorithm 1) per k, prefill per prompt length — for greedy (temperature 0: argmax) and
sampled (softmax over the vocabulary) decoding, and writes them to
``reports/profiles/<hardware>.json`` (or ``sim.profile_path``).

A target forward over k tokens costs ``forward[k, context] + accept[k]`` (a verification
includes Algorithm 1; under `schedule=ar` it is ``+ pick``, the argmax or draw of the token); a draft forward costs
``forward[k, context]`` including its pick; an n-gram draft's lookup is spread over the γ
forwards the schedule asks for. Interpolation is bilinear on the measured grid (exact on grid
points, monotone between two of them), linear extrapolation beyond it.

Tensor parallelism and input shape (profile schema 2, real/calibrate/tp.py): per model, tables
measured by pinned single-thread workers at TP 1 and 2 for chain-shaped (k causal tokens) and
tree-shaped (k tree nodes, tree mask over the cached slots) forwards. A forward at the group's
TP degree n (testbed.placement: ``placement.target_gpus`` for `single`, both models on
max(target_gpus, draft_gpus) for the serial tree's `tree` layout, each group its own for `async`)
and shape s costs ``forward[k, context] · tp[n][s] / tp[1][chain]`` at (k, context): the level
stays the main table's (and follows ``profile_rescale``), the TP tables say how much a degree
and a shape change it (both measured side by side, so the machine's drift cancels). The ratio
is read at (k, context) clamped to the TP grid. An early-exit draft uses the target's ratios,
an n-gram draft none. Profiles of schema 1 (no TP tables) serve TP 1 (both shapes as chains);
a run at TP > 1 on one fails with one line asking to recalibrate. A transformer draft's
tree-shaped forward is the exception (sim/cost/profile_tables.TreeDraftForward): the main table
times its chain step, whose LM head projects the last token only, while a tree expansion needs
every node's logits, so its shape in k comes from the TP tree table (every row's logits) from
one token on, at the main table's one-token level. An eagle head's likewise, its shape in k from
the head's batched table (sim/cost/profile_tables.EagleTreeForward).

Sampling mode (real/calibrate/sampling.py): the forward tables include standardizing at their
temperature class (argmax; a T=1 softmax). A run with top-k and/or top-p also pays, per draft
token and per verified distribution, ``sampling.seconds[mode] - seconds[class mode]`` of the
model's "sampling" node; a profile without it charges nothing extra and says so once (log).

Contention (real/calibrate/contention.py): where the two groups run at once (`async`), a
forward of one model is slower while the other core streams the other model's weights (shared
memory bus and cache on a CPU). When the profile measured it (``contended[other model]``, factor
against k), the forward is multiplied by that factor; ``contention_factor`` says how big it is.

``sim.profile_rescale=true`` with ``acceptance=trace``: the tables keep their shape in context
but are scaled to the round times the trace's real runs recorded — per role, and for the target
per k where enough rounds verified k tokens (on a shared machine the speed, and even the shape
in k, drift between calibration and the runs; `+sweep=validate` uses this with the
trace-split run of each grid point, never the run it predicts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.cost import profile_rescale
from sim.cost.base import CostModel, Role, register
from sim.cost.profile_tables import (
    CALIBRATE_CMD,
    EagleTreeForward,
    ShapeFactor,
    Table1D,
    Table2D,
    TreeDraftForward,
    interp1,
    load_profile,
    sampling_extra,
    temperature_class,
)
from testbed.config import ConfigError, ExperimentConfig
from testbed.links import LinkModel
from testbed.machine import FORWARD_PROBE_CONTEXT
from testbed.paths import TIMED_CODE, profile_path, timed_code_digest
from testbed.placement import tp_degrees  # noqa: F401  (re-exported: the TP degree per role)
from testbed.schedules import spec_of


class ProfileCost(CostModel):
    def __init__(self, exp: ExperimentConfig, profile: dict[str, Any] | None = None,
                 path: Path | None = None) -> None:
        from testbed.spec.sampling import SamplingParams, sampling_mode

        self.path = path or profile_path(exp)
        self.profile = profile if profile is not None else load_profile(self.path)
        _warn_other_code(self.profile, self.path)
        self.temp = temperature_class(exp.sampling.temperature)
        params = SamplingParams(exp.sampling.temperature, top_k=exp.sampling.top_k, top_p=exp.sampling.top_p)
        self.sampling_mode = sampling_mode(params)
        self.modes = {"target": self.sampling_mode, "draft": self.sampling_mode}
        spec = spec_of(exp)
        if "schedule.draft_topk" in spec.reads:  # DSD's draft samples from its top-k (testbed.spec.dsd)
            from testbed.spec.dsd import draft_params

            self.modes["draft"] = sampling_mode(draft_params(params, exp.schedule.draft_topk))
        self.sampling_extra_s: dict[str, float] = {}  # per distribution, by role
        self.gamma = max(1, exp.schedule.gamma)
        self.names = {"target": exp.pair.target.name, "draft": exp.pair.draft.name}
        self.kinds = {"target": exp.pair.target.kind, "draft": exp.pair.draft.kind}
        self.configs = {"target": exp.pair.target, "draft": exp.pair.draft}
        self._forward: dict[str, Table2D | Table1D] = {}
        self._accept: Table1D | None = None
        self._pick = 0.0
        self.ar = not spec.drafts
        self._prefill: dict[str, Table1D | None] = {}
        self._tree_expand: Table1D | None = None  # a draft tree expansion beyond its forward
        self._tree_rounds: tuple[Table1D, Table1D] | None = None  # a tree's (select, re-root) per round
        self.degree = tp_degrees(exp)
        self._factor: dict[str, ShapeFactor | None] = {}
        # a transformer draft's or an eagle head's tree-shaped forward (every node's logits)
        self._tree_draft: TreeDraftForward | EagleTreeForward | None = None
        # batched forwards (real/calibrate/batch.py): (seconds over (k per request, B), their context)
        self._batch: dict[str, tuple[Table2D, int]] = {}
        self.warm_draft = 1.0  # a draft step after a draft step, over one alone (run_probe sets it)
        # async: the groups run concurrently; factor against k with the other group busy
        self._contended: dict[str, tuple[list[float], list[float]]] = {}
        self.concurrent = spec.concurrent
        for role in ("target", "draft"):
            if role == "draft" and not spec.drafts:
                continue
            self._bind(role)
        self.scale = {"target": 1.0, "draft": 1.0}
        self.scale_k: dict[int, float] = {}  # target, per tokens verified
        if exp.sim.profile_rescale and exp.acceptance.oracle == "trace" and exp.acceptance.trace_path:
            from sim.oracle.trace import select_trace_runs

            runs = select_trace_runs(Path(exp.acceptance.trace_path).expanduser(), exp)
            self.fit_scale([d for d, s in runs if s.get("hardware") == exp.hardware.name
                            and s.get("backend") == "real"])
        # sim.profile_drift: the machine now against the profile's, per role (sim/cost/profile_drift.py)
        from sim.cost.profile_drift import apply_profile_drift

        apply_profile_drift(self, exp)

    def probe_seconds(self, role: str, tokens: int = 1) -> float | None:
        """The profile's time for a probe forward real runs time (real/calibrate/probe_forward.py):
        ``tokens`` tokens at ``FORWARD_PROBE_CONTEXT`` at the role's TP degree, alone — chain-shaped
        with distributions (the target), every row's logits (a draft over more than one token, as
        its tree expansions); None for a model without such a forward (the n-gram lookup).
        From the very table a prediction reads (the run's temperature class), so that at a probed
        size the table's own error cancels: one point alone erred by ±10 % on this host."""
        table = self._forward.get(role)
        if not isinstance(table, Table2D):
            return None
        if role == "draft" and tokens > 1:
            return None if self._tree_draft is None else self._tree_draft(tokens, FORWARD_PROBE_CONTEXT)
        t = table(tokens, FORWARD_PROBE_CONTEXT)
        if role == "draft":
            # The draft's table times a draft step: its forward *and the pick of its guess*
            # (real/calibrate/profile.add_draft_probes), which the probe does not make. At T = 1 that
            # is a draw over the vocabulary, 1.2 ms against the bundled draft's 3 ms forward
            # here: compared with it, every T = 1 prediction scaled its draft by ~0.7.
            t = max(t - self.pick_seconds(), 0.5 * t)
        factor = self._factor.get(role)
        return t * factor("chain", tokens, FORWARD_PROBE_CONTEXT) if factor is not None else t

    def pick_seconds(self) -> float:
        """One pick of a token from a distribution at the run's temperature class (argmax, or one
        draw), as the profile timed it for the target: the draft picks over the same vocabulary."""
        pick = self._model("target").get("pick") or {}
        return float(pick.get(self.temp, next(iter(pick.values())))) if pick else 0.0

    def apply_drift(self, factors: dict[str, float]) -> None:
        """Scale ``factors``' roles by them too (a prediction's `ar` baseline takes the
        prediction's own drift: the real run's baseline ran in the same processes)."""
        for role, f in factors.items():
            if role in self.scale:
                self.scale[role] *= f
                self.drift_by_role[role] = self.drift_by_role.get(role, 1.0) * f
        self.drift = self.drift_by_role["target"]

    def _model(self, role: str) -> dict[str, Any]:
        models = self.profile.get("models", {})
        name = self.names[role]
        if name not in models:
            raise ConfigError(f"pair.{role}", name,
                              f"a model the profile {self.path} measured ({', '.join(sorted(models)) or 'none'}); "
                              f"measure it with `{CALIBRATE_CMD} pair={self.names['target']}+{self.names['draft']}`")
        return models[name]

    def _by_temp(self, node: dict[str, Any]) -> dict[str, Any]:
        # the other class is a better guess than nothing (it differs by one softmax over V)
        return node.get(self.temp) or next(iter(node.values()))

    def _bind(self, role: str) -> None:
        m = self._model(role)
        if m.get("kind") == "ngram":
            self._forward[role] = Table1D(self._by_temp(m["propose"]), "context")
        else:
            self._forward[role] = Table2D(self._by_temp(m["forward"]))
        if role == "target" and self.ar:  # `ar` picks from p (argmax or one draw)
            pick = m.get("pick", {})
            self._pick = float(pick.get(self.temp, next(iter(pick.values()), 0.0)))
        elif role == "target":
            self._accept = Table1D(self._by_temp(m["accept"]), "k")
        pf = m.get("prefill")
        self._prefill[role] = Table1D(pf, "prompt_len") if pf else None
        if role == "draft" and m.get("tree_expand"):  # real/calibrate/tree.py
            self._tree_expand = Table1D(self._by_temp(m["tree_expand"]), "leaves")
        if role == "draft" and m.get("tree_rounds"):  # real/calibrate/tree.time_bookkeeping
            t = self._by_temp(m["tree_rounds"])
            self._tree_rounds = (Table1D({"leaves": t["leaves"], "seconds": t["select_s"]}, "leaves"),
                                Table1D({"leaves": t["leaves"], "seconds": t["advance_s"]}, "leaves"))
        mode = self.modes[role]
        extra = None if m.get("kind") == "ngram" else sampling_extra(m, mode)
        if extra is None and m.get("kind") != "ngram" and mode.startswith("top"):
            import logging

            logging.getLogger(__name__).warning(
                "profile %s has no sampling costs for %s: %s charged as plain temperature "
                "sampling; measure it again with `%s`", self.path, self.names[role],
                mode, CALIBRATE_CMD)
        self.sampling_extra_s[role] = extra or 0.0
        self._factor[role] = self._bind_tp(role, m)
        if m.get("batch") and self.degree[role] == 1:
            b = self._by_temp(m["batch"])  # Table2D's second axis holds the batch sizes here
            self._batch[role] = (Table2D({"k": b["k"], "context": b["batch"], "seconds": b["seconds"]}),
                                 int(b["context"]))
        forward = self._forward[role]
        if role == "draft" and m.get("kind") == "transformer" and m.get("tp") and isinstance(forward, Table2D):
            self._tree_draft = TreeDraftForward(forward, m["tp"], self.degree[role])
        elif role == "draft" and m.get("kind") == "eagle" and role in self._batch and isinstance(forward, Table2D):
            self._tree_draft = EagleTreeForward(forward, self._batch[role][0])  # type: ignore[assignment]
        other = self.names["draft" if role == "target" else "target"]
        c = m.get("contended", {}).get(other)
        if self.concurrent and c:
            self._contended[role] = ([float(k) for k in c["k"]], [float(f) for f in c["factor"]])

    def contention_factor(self, role: str, tokens: int) -> float:
        """How much slower ``role``'s forward over ``tokens`` is while the other group runs (1: not
        measured, or the groups never run at once)."""
        c = self._contended.get(role)
        if c is None:
            return 1.0
        ks, factors = c
        return max(1.0, interp1(min(max(float(tokens), ks[0]), ks[-1]), ks, factors))  # never faster

    def _bind_tp(self, role: str, m: dict[str, Any]) -> ShapeFactor | None:
        """The TP/shape ratios of this role's model at its group's degree (module docstring)."""
        if m.get("kind") == "ngram":
            return None
        if m.get("kind") == "early_exit":  # the target's layers: the target's ratios
            m = self._model("target")
        degree = self.degree[role]
        tables = m.get("tp")
        key = "placement.target_gpus" if role == "target" else "placement.draft_gpus"
        if not tables:
            if degree == 1:
                return None
            raise ConfigError(key, str(degree), f"TP 1: the profile {self.path} has no tensor-parallel "
                              f"tables (schema {self.profile.get('schema')}); measure it again with "
                              f"`{CALIBRATE_CMD}`")
        if str(degree) not in tables or "1" not in tables:
            raise ConfigError(key, str(degree), f"a TP degree the profile {self.path} measured "
                              f"({', '.join(sorted(tables))}); measure it on a machine with "
                              f"{degree} cores with `{CALIBRATE_CMD}`")
        return ShapeFactor(tables, degree)

    def recorded_rounds(self, run_dir: Path) -> list[tuple[int, int, int, float, float, float, float]]:
        """sim/cost/profile_rescale.recorded_rounds of this model."""
        return profile_rescale.recorded_rounds(self, run_dir)

    def fit_scale(self, run_dirs: list[Path]) -> None:
        """sim/cost/profile_rescale.fit_scale on this model."""
        profile_rescale.fit_scale(self, run_dirs)

    def forward(self, role: Role, tokens: int, context: int,
                layers: tuple[int, int] | None = None, *, _raw: bool = False, shape: str = "chain",
                alone: bool = False) -> float:
        t = self._forward_unscaled(role, tokens, context=context, layers=layers, shape=shape, alone=alone)
        if _raw:
            return t
        return t * self.role_scale(role, tokens)

    def batch_forward(self, role: Role, rows: Sequence[tuple[int, int]], *, tree: bool = False) -> float:
        """A forward over several requests from the batched tables where the profile has them
        (real/calibrate/batch.py: B requests x k tokens at one context, interpolated at the
        batch's mean tokens per request), plus each request's attention beyond that context from
        the one-request table, and per request Algorithm 1 (the target; `ar`: its pick); without
        them the additive model of ``CostModel.batch_forward``."""
        batched = self._batch.get(role)
        if batched is None or tree or len(rows) == 1:
            return super().batch_forward(role, rows, tree=tree)
        table, context = batched
        one = self._forward[role]
        total = sum(k for k, _ in rows)
        t = table(total / len(rows), len(rows))
        t += sum(one(k, c) - one(k, context) for k, c in rows)
        if role == "target":
            t += sum(self._pick if self._accept is None else self._accept(k) for k, _ in rows)
        t += (total if role == "target" else len(rows)) * self.sampling_extra_s.get(role, 0.0)
        # the machine's drift at the forward's rows (sim.profile_drift=run_probe measures it per k:
        # a batch of many rows is compute bound like a long verification, unlike one token)
        return t * self.role_scale(role, total)

    def draft_chain(self, pending: int, forwards: int, seq_len: int, _raw: bool = False) -> float:
        """A chain draft phase, its steps after the first at ``warm_draft`` times the table's:
        the table (and a round's first step, after the target's verification streamed its
        weights through the caches) is a draft forward alone; the next steps follow a draft
        forward (sim/cost/run_probe.warm_step_ratio)."""
        first = self.forward("draft", pending, seq_len - pending, _raw=_raw)
        rest = sum(self.forward("draft", 1, seq_len + i - 1, _raw=_raw) for i in range(1, forwards))
        return first + self.warm_draft * rest

    def role_scale(self, role: str, tokens: int) -> float:
        """The multiplier of ``role``'s forward over ``tokens``: the rescale (per k for the
        target) or the drift; under run_probe the drift per k (sim/cost/profile_drift.py)."""
        if self.k_factor is not None:
            return self.scale[role] * self.k_factor(role, tokens)
        return self.scale_k.get(tokens, self.scale["target"]) if role == "target" else self.scale[role]

    def tree_forward(self, role: Role, tokens: int, context: int, alone: bool = False) -> float:
        return self.forward(role, tokens, context, shape="tree", alone=alone)

    def tree_expand_extra(self, leaves: int) -> float:
        # on every rank of a TP group alike (each selects over the whole vocabulary): no TP factor
        table = self._tree_expand
        return 0.0 if table is None else table(leaves) * self.role_scale("draft", leaves)

    def tree_round_bookkeeping(self, leaves: int) -> tuple[float, float]:
        if self._tree_rounds is None:
            return 0.0, 0.0
        scale = self.role_scale("draft", 1)  # Python on the draft's cores: drifts as its forward
        select, advance = self._tree_rounds
        return select(leaves) * scale, advance(leaves) * scale

    def _forward_unscaled(self, role: Role, tokens: int, *, context: int,
                          layers: tuple[int, int] | None, shape: str = "chain", alone: bool = False) -> float:
        table = self._forward[role]
        decide = 0.0  # the target's accept or pick: on the last stage, which verifies
        if isinstance(table, Table1D) and shape == "tree" and self._tree_expand is not None:
            t = 0.0  # an n-gram tree expansion is timed whole, lookups included (tree_expand_extra)
        elif isinstance(table, Table1D):  # n-gram lookup: one per round, spread over γ calls
            t = table(context) / self.gamma
        elif role == "draft" and shape == "tree" and self._tree_draft is not None:
            t = self._tree_draft(tokens, context)  # every node's logits (TreeDraftForward)
            if not alone:
                t *= self.contention_factor(role, tokens)
        else:
            t = table(tokens, context)
            factor = self._factor.get(role)
            if factor is not None:
                t *= factor(shape, tokens, context)
            if not alone:
                t *= self.contention_factor(role, tokens)
            if role == "target":
                decide = self._pick if self._accept is None else self._accept(tokens)
        n_layers = hi = 0
        if layers is not None:  # a pipeline stage: its share of the weights (the head on the last)
            lo, hi = layers
            n_layers = max(1, self.profile["models"][self.names[role]].get("layers", hi - lo))
            cfg = self.configs[role]
            t *= cfg.stage_share(lo, hi) if cfg.layers == n_layers else (hi - lo) / n_layers
        if layers is None or hi >= n_layers:  # the last stage standardizes: one distribution
            # per verified position / drafted token (a tree expansion drafts from each node)
            per_forward = tokens if role == "target" or shape == "tree" else 1
            t += decide + per_forward * self.sampling_extra_s.get(role, 0.0)
        return t

    def prefill(self, role: Role, prompt_len: int) -> float:
        table = self._prefill.get(role)
        if table is None:
            return 0.0
        factor = self._factor.get(role)  # a prefill is a long chain: the ratio at the longest k
        ratio = 1.0 if factor is None else factor("chain", prompt_len, 0)
        return table(prompt_len) * ratio * self.role_scale(role, prompt_len)

    def decode_seconds(self, run_dir: Path) -> dict[int, float]:
        """Modelled decode time per request of a recorded real run, with its own acceptance."""
        return profile_rescale.decode_seconds(self, run_dir)

    @property
    def link(self) -> dict[str, float] | None:
        """α–β of messages between two worker processes (gloo on loopback), if measured."""
        return self.profile.get("links", {}).get("gloo_loopback")

    def bridge_link(self, name: str) -> LinkModel | None:
        """The async bridge between the two groups of this host as measured
        (real/calibrate/bridge.py: the testbed's transport, the sender computing), as a link
        model named ``name``; None when the profile has no such table (hardware links then)."""
        table = self.profile.get("links", {}).get("bridge")
        if not table:
            return None
        beta = float(table["beta_s_per_byte"])
        return LinkModel(name, float(table["alpha_s"]), 1.0 / beta if beta > 0 else math.inf, 0.0)


@register("profile")
def make_profile_cost(exp: ExperimentConfig) -> CostModel:
    return ProfileCost(exp)


_warned: set[str] = set()


def _warn_other_code(profile: dict[str, Any], path: Path) -> None:
    """Once per profile: it was measured with other kernels, models or speculative algorithms than
    this checkout's (testbed.paths.timed_code_digest), so its tables may time what changed."""
    code = profile.get("code")
    if code == timed_code_digest() or str(path) in _warned:
        return
    _warned.add(str(path))
    import logging

    logging.getLogger(__name__).warning(
        "profile %s was measured with other code of %s (digest %s, now %s): predictions use "
        "its tables as measured; measure it again with `%s`", path, ", ".join(TIMED_CODE), code,
        timed_code_digest(), CALIBRATE_CMD)
