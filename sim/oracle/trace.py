"""`acceptance=trace`: replay the acceptance a real run recorded (its rounds.parquet).

A real `sync` run records, per verification, how many guesses the draft proposed (`drafted`)
and how many the target kept (`accepted`). Laid end to end, a request's rounds give a
per-position *match stream* of the generated sequence: in a round starting at position j that
kept n of d guesses, positions j..j+n-1 matched the target, position j+n did not (when n < d),
and the bonus position after a fully accepted round is unobserved. At temperature 0 with a
model draft this stream is exactly what decides every round at any γ (the draft's guess at a
position depends on the committed prefix only), so a trace taken at one γ drives another.

Replay per request: simulated request i follows recorded request i mod N from its start (a
prompt's acceptance is its own: n-gram drafts accept far more on some prompts than on others,
and tokens/s is a mean of per-request rates). With the trace's γ each recorded round is replayed
as it was (exact: the accepted-length distribution is reproduced); with another γ the stream is
walked position by position and unobserved positions are drawn with the stream's match rate
from the simulation's seed. Decisions go through testbed.spec.speculative.accepted_prefix with
ratios 1 (match) / 0 (mismatch), like every other oracle.

Serial token trees (`sync` + ``schedule.tree=true``) replay a recorded serial-tree run: round i
of a simulated request accepts as many tree nodes as round i of its recorded request did
(sim.oracle.tree_tokens.TraceTreeTokens walks the most probable path of the batch that far), and a
round that drafted nothing (an n-gram draft without a continuation) verifies the root alone.
With the recorded tree shape (w, bs, d) this reproduces every round; with another shape the
accepted count is capped by the batch's depth. The replayed trees grow from the recorded draft's
ranked rows where the run kept them (its draft_rows.json, testbed.spec.tree_drafter.DraftRowSample).

``acceptance.trace_path`` is a real run directory, its rounds.parquet, or a directory of runs
(e.g. a validation sweep): then runs are filtered by the experiment key (schedule sync, or
sync_tree for a tree; pair, workload, temperature; γ, the tree shape and the TP degree preferred), and runs on the prompt split that feeds the experiment's
split are preferred (testbed.workloads.TRACE_SOURCE: `calibrate` for `holdout`, `trace` for
`test`); a prediction never replays its own prompts' acceptance.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from sim.oracle.base import ORACLES, ChainOutcome, SequenceOracle, TokenOracle
from testbed.arrivals import under_load
from testbed.config import ConfigError, ExperimentConfig
from testbed.results import run_split
from testbed.schedules import describe, names_where, schedule_impl, spec, spec_of, tree_variant
from testbed.spec.lookahead import FEATURES, Decision, LookaheadPolicy
from testbed.spec.speculative import accepted_prefix
from testbed.workloads import TRACE_SOURCE


def howto(exp: ExperimentConfig) -> str:
    """How to record the trace this experiment asks for: a real run of the same pair, workload,
    temperature and schedule kind (a command that recorded another pair would not be found)."""
    source = spec_of(exp).trace_from or schedule_impl(exp)  # the recording its replay selects
    if exp.schedule.tree:  # with a tree flag: that schedule's tree variant, where it has one
        source = getattr(tree_variant(source), "name", source)
    kind = f"schedule={spec(source).schedule}" + (" schedule.tree=true" if spec(source).tree_of else "")
    temp = f" sampling.temperature={exp.sampling.temperature:g}" if exp.sampling.temperature else ""
    return (f"record one with `python -m testbed backend=real {kind} pair={exp.pair.name} "
            f"workload={exp.workload.name}{temp} workload.split=calibrate` "
            "(or run `python -m testbed +sweep=validate`)")


@dataclass
class RequestTrace:
    """One recorded request: its rounds in order, as (drafted, accepted)."""

    rounds: list[tuple[int, int]]
    gamma: int  # the recorded run's schedule.gamma (its lookahead cap)
    # per round, the drafted tokens' features (testbed.spec.lookahead; empty: not recorded)
    features: list[list[list[float]]] | None = None
    # a tree run's ranked draft rows (draft_rows.json, testbed.spec.tree_drafter.DraftRowSample)
    draft_rows: list[list[float]] | None = None

    def __post_init__(self) -> None:
        # match[j]: 1 matched, 0 rejected, -1 unobserved; starts[j]: round index starting at j
        self.match: list[int] = []
        self.starts: dict[int, int] = {}
        self.covering: list[tuple[int, int]] = []  # per position: (round start, drafted)
        for idx, (d, n) in enumerate(self.rounds):
            j = len(self.match)
            self.starts[j] = idx
            # n matches, then the rejected guess (or, after a full round or when nothing was
            # proposed, a bonus position whose match is unobserved)
            self.match += [1] * n + ([0] if n < d else [-1])
            self.covering += [(j, d)] * (len(self.match) - j)
        known = [m for m in self.match if m >= 0]
        self.match_rate = sum(known) / len(known) if known else 0.0
        self._index_features()

    def _index_features(self) -> None:
        """Features per stream position (the guess drafted there from the committed prefix) and
        pools: matched / rejected positions' features, and guesses drafted after a rejection
        in their round (drawn where the replay leaves the recorded stream)."""
        self.at: dict[int, list[float]] = {}
        self.pools: dict[str, list[list[float]]] = {"match": [], "reject": [], "after": []}
        if not self.features:
            return
        for j, idx in self.starts.items():
            d, n = self.rounds[idx]
            for i, row in enumerate(self.features[idx][:d]):
                if i <= n:
                    self.at[j + i] = row
                    self.pools["match" if i < n else "reject"].append(row)
                else:
                    self.pools["after"].append(row)
        for name, alt in (("reject", "after"), ("after", "reject"), ("match", "reject")):
            if not self.pools[name]:
                self.pools[name] = self.pools[alt] or self.pools["match"] or self.pools["reject"]

    @property
    def length(self) -> int:
        return len(self.match)


def _runs_below(path: Path) -> list[tuple[Path, dict]]:
    found = [path / "summary.json"] if (path / "summary.json").exists() else sorted(path.rglob("summary.json"))
    out = []
    for s in found:
        try:
            out.append((s.parent, json.loads(s.read_text())))
        except (OSError, ValueError) as e:
            raise ConfigError("acceptance.trace_path", str(path),
                              f"run directories with readable files: {s} is corrupt ({e})") from None
    return out


def select_trace_runs(path: Path, exp: ExperimentConfig) -> list[tuple[Path, dict]]:
    """The recorded runs that drive this experiment (see the module docstring)."""
    if path.is_file():
        if path.name != "rounds.parquet":
            raise ConfigError("acceptance.trace_path", str(path), "a run directory or its rounds.parquet")
        path = path.parent
    if not path.exists():
        raise ConfigError("acceptance.trace_path", str(path), f"an existing directory; {howto(exp)}")
    # the recorded implementations this one replays (its declaration's ``replays``: DSD replays
    # DSD, whose rounds hold the adaptive rule's outcomes; async its own rounds, else a serial
    # tree's; `ar`, a prediction's baseline, any recorded run)
    wanted = set(spec_of(exp).replays)
    runs = [(d, s) for d, s in _runs_below(path) if s.get("schedule") in wanted
            and (d / "rounds.parquet").exists()]
    if (path / "summary.json").exists():
        return runs  # one run named explicitly: use it whatever its key
    runs = [(d, s) for d, s in runs
            if s.get("pair") == exp.pair.name and s.get("workload") == exp.workload.name
            and float(s.get("temperature", -1)) == float(exp.sampling.temperature)]
    own = exp.workload.split
    source = [(d, s) for d, s in runs if run_split(d, s) == TRACE_SOURCE.get(own, "calibrate")]
    if source:
        runs = source
    elif spec_of(exp).pipelined and any(run_split(d, s) == own for d, s in runs):
        # `+sweep=wan`: a WAN prediction is about time, so it replays the measured grid point's
        # own rounds (the preferences below pick that run)
        runs = [(d, s) for d, s in runs if run_split(d, s) == own]
    elif own != "all" and spec_of(exp).drafts:  # never replay the predicted prompts' own
        # acceptance (`ar` accepts nothing: a WAN prediction's baseline may use its own run)
        runs = [(d, s) for d, s in runs if run_split(d, s) not in (own, "all")]
    if exp.backend == "sim":
        real = [(d, s) for d, s in runs if s.get("backend") == "real"]
        runs = real or runs
    # a per-token policy replays the features of a static run (it drafted every position),
    # whichever policy it predicts; other policies prefer a recording of themselves
    runs = [(d, s) for d, s in runs if _static_recording(s, exp)] or runs
    for same in (_same_schedule, _same_gamma, _same_tree, _same_tp, _same_dsd, _same_load):  # preferences, in order: narrow if any match
        runs = [(d, s) for d, s in runs if same(s, exp)] or runs
    return runs


def _static_recording(s: dict, exp: ExperimentConfig) -> bool:
    own = exp.lookahead.policy
    wanted = "static" if own in ("confidence", "disco", "oracle") else own
    return s.get("lookahead", "static") == wanted


def _same_schedule(s: dict, exp: ExperimentConfig) -> bool:
    return s.get("schedule") == schedule_impl(exp)


def _same_gamma(s: dict, exp: ExperimentConfig) -> bool:
    return int(s.get("gamma", -1)) == exp.schedule.gamma


def _same_tree(s: dict, exp: ExperimentConfig) -> bool:
    t = exp.schedule
    if spec_of(exp).concurrent:  # d is chosen at run time (async) unless schedule.tree_depth sets it
        return (s.get("tree_width") == t.tree_width and s.get("tree_budget") == t.tree_budget
                and (not t.tree_depth or s.get("tree_depth_used") == t.tree_depth))
    return not t.tree or (s.get("tree_width") == t.tree_width and s.get("tree_budget") == t.tree_budget
                          and s.get("tree_depth_used") == (t.tree_depth or t.gamma))


def _same_dsd(s: dict, exp: ExperimentConfig) -> bool:
    """A decentralized run of the same pipeline, links and relaxation (τ changes acceptance)."""
    if not spec_of(exp).pipelined:
        return True
    tau = exp.schedule.tau if exp.schedule.adaptive else 0.0
    return (s.get("nodes") == exp.placement.nodes and s.get("latency_ms") == exp.network.latency_ms
            and float(s.get("tau") or 0.0) == tau)


def _same_tp(s: dict, exp: ExperimentConfig) -> bool:
    """Acceptance does not depend on the TP degree, round times (profile_rescale) do."""
    return (s.get("target_gpus"), s.get("draft_gpus")) == (exp.placement.target_gpus, exp.placement.draft_gpus)


def _same_load(s: dict, exp: ExperimentConfig) -> bool:
    """A run under the same load (one request at a time: none): acceptance does not depend on
    it, but a run under load may not have recorded what a one-request prediction replays."""
    w = exp.workload
    if not under_load(w):
        return s.get("arrival") is None
    if s.get("arrival") != w.arrival:
        return False
    return s.get("concurrency") == w.concurrency if w.arrival == "closed" else \
        s.get("rate") == w.rate if w.arrival == "poisson" else True


def load_trace(exp: ExperimentConfig) -> list[RequestTrace]:
    """Every recorded request of the selected runs, in order; ConfigError when there is none.
    Per-token draft features are loaded when the lookahead policy reads them."""
    # `ar` (a prediction's baseline, which keeps the policy setting) drafts nothing
    with_features = exp.lookahead.policy in ("confidence", "disco") and spec_of(exp).drafts
    raw = exp.acceptance.trace_path
    if not raw:
        raise ConfigError("acceptance.trace_path", raw, f"a real run directory (acceptance=trace replays one); {howto(exp)}")
    path = Path(raw).expanduser()
    runs = select_trace_runs(path, exp)
    if not runs:
        raise ConfigError("acceptance.trace_path", raw,
                          f"a directory with a recorded {'sync_tree' if exp.schedule.tree else 'sync'} run of pair={exp.pair.name} "
                          f"workload={exp.workload.name} temperature={exp.sampling.temperature} "
                          f"(none found); {howto(exp)}")
    traces: list[RequestTrace] = []
    for run_dir, summary in runs:
        try:
            rounds = pd.read_parquet(run_dir / "rounds.parquet")
        except Exception as e:  # pyarrow raises several kinds for a damaged file
            raise ConfigError("acceptance.trace_path", raw, f"run directories with readable traces: "
                              f"{run_dir / 'rounds.parquet'} is not a readable parquet file "
                              f"({' '.join(str(e).split())}); re-record it") from None
        gamma = int(summary.get("gamma", 0))
        draft_rows = _draft_rows(run_dir, raw)
        feature_rows = rounds["draft_features"] if "draft_features" in rounds.columns else None
        if with_features and (feature_rows is None or not feature_rows.map(len).any()):
            raise ConfigError("acceptance.trace_path", raw, f"a trace with per-token draft features for "
                              f"lookahead={exp.lookahead.policy} ({run_dir} has none: real runs record them on "
                              f"workload.split=trace or calibrate, or with a policy that reads them); {howto(exp)}")
        for _, g in rounds.sort_values(["request_id", "round"]).groupby("request_id", sort=True):
            recs = list(zip(g["drafted"].astype(int), g["accepted"].astype(int)))
            feats = None
            if with_features:
                flat = feature_rows.loc[g.index] if feature_rows is not None else []
                feats = [[list(map(float, f[i:i + FEATURES])) for i in range(0, len(f), FEATURES)] for f in flat]
            if recs:
                traces.append(RequestTrace(recs, gamma, feats, draft_rows))
    if not traces:
        raise ConfigError("acceptance.trace_path", raw, f"a run with recorded rounds (its rounds.parquet is empty); {howto(exp)}")
    return traces


def _draft_rows(run_dir: Path, raw: str) -> list[list[float]] | None:
    """The run's ranked draft rows (a tree run's draft_rows.json); None when not recorded."""
    path = run_dir / "draft_rows.json"
    if not path.exists():
        return None
    try:
        rows = json.loads(path.read_text())["draft_rows"]
        return [[float(v) for v in row] for row in rows] or None
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError("acceptance.trace_path", raw, f"run directories with readable traces: {path} is "
                          "not a draft_rows.json a real tree run writes; re-record the run or delete the file") from None


class TraceSequence(SequenceOracle):
    """Walks one recorded request; wraps around when the simulation outlasts the recording."""

    def __init__(self, trace: RequestTrace, rng: random.Random) -> None:
        self.trace, self.rng, self.pos = trace, rng, 0

    def ar_token(self) -> int:
        self.pos = (self.pos + 1) % self.trace.length
        return -1

    def _matched(self, j: int) -> bool:
        m = self.trace.match[j % self.trace.length]
        return m == 1 if m >= 0 else self.rng.random() < self.trace.match_rate

    def _proposals(self, gamma: int) -> int:
        """Guesses a draft proposes here: γ for drafts that always fill the window; for n-gram
        lookups, what the recorded round covering this position had left."""
        start, drafted = self.trace.covering[self.pos]
        if drafted >= self.trace.gamma:
            return gamma
        return max(0, min(gamma, drafted - (self.pos - start)))

    def _features(self, j: int, matched: bool, on_stream: bool) -> list[float] | None:
        t = self.trace
        if not t.pools["match"] and not t.pools["reject"]:
            return None
        row = t.at.get(j % t.length) if on_stream else None
        if row is None:
            pool = t.pools["after"] if not on_stream else t.pools["match" if matched else "reject"]
            row = pool[self.rng.randrange(len(pool))]
        return row

    def _policy_round(self, gamma: int, policy: LookaheadPolicy) -> ChainOutcome:
        """A round whose length the policy decides token by token: features from the recorded
        guess at each stream position (drawn from the request's pools where none was recorded,
        or after the round's first rejection, where the draft left the recorded stream)."""
        cap = self._proposals(gamma)
        ratios: list[float] = []
        dropped, off_stream = 0, False
        for i in range(cap):
            ok = False if off_stream else self._matched(self.pos + i)
            feats = self._features(self.pos + i, ok, not off_stream) if policy.needs_features else None
            decision = policy.after_token(features=feats, position=i + 1,
                                          accepted=ok if policy.needs_acceptance else None)
            if decision is Decision.DROP:
                dropped = 1
                break
            ratios.append(1.0 if ok else 0.0)
            off_stream = off_stream or not ok
            if decision is Decision.STOP:
                break
        n = accepted_prefix(ratios, [1.0] * len(ratios))
        self.pos = (self.pos + n + 1) % self.trace.length
        return ChainOutcome(accepted=n, ratios=ratios, proposed=len(ratios), dropped=dropped)

    def chain_round(self, gamma: int, policy: LookaheadPolicy | None = None) -> ChainOutcome:
        t = self.trace
        if policy is not None and policy.per_token:
            return self._policy_round(gamma, policy)
        idx = t.starts.get(self.pos)
        if idx is not None and gamma == t.gamma:  # the recorded round, exactly
            drafted, accepted = t.rounds[idx]
            ratios = [1.0] * accepted + [0.0] * (drafted - accepted)
        else:
            drafted = self._proposals(gamma)
            ratios = []
            for i in range(drafted):
                ratios.append(1.0 if self._matched(self.pos + i) else 0.0)
                if not ratios[-1]:
                    break
            ratios += [0.0] * (drafted - len(ratios))
        n = accepted_prefix(ratios, [1.0] * drafted)  # r = 1 accepts ratio 1, rejects ratio 0
        self.pos = (self.pos + n + 1) % t.length
        return ChainOutcome(accepted=n, ratios=ratios, proposed=drafted)


class TraceOracle(TokenOracle):
    def __init__(self, exp: ExperimentConfig, seed: int) -> None:
        if not spec_of(exp).replays:
            replaying = ", ".join(describe(n) for n in names_where(lambda s: bool(s.replays)))
            raise ConfigError("acceptance", "trace", f"iid or synthetic with schedule={exp.schedule.name} "
                              f"(a trace replays the rounds of {replaying})")
        self.traces = load_trace(exp)
        self.seed = seed

    def sequence(self, request_id: int, prompt_len: int) -> SequenceOracle:
        trace = self.traces[request_id % len(self.traces)]
        return TraceSequence(trace, random.Random(1_000_003 * self.seed + request_id))


ORACLES.register("trace", TraceOracle)
