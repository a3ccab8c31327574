"""Lookahead policies: how far the draft drafts in a round (DESIGN: lookahead=...).

Two decisions, both capped at γ = ``schedule.gamma`` (SL_max):

- before a round, ``next_gamma()``: the window's cap (static: γ; heuristic: HF's +2/−1);
- after every draft token, ``after_token(features=, position=, accepted=)``: keep drafting,
  stop after this token, or (oracle only) drop this token and stop. Real drafts
  (real/model/drafts.py) and the simulator's oracles (sim/oracle/) call it the same way, with the
  same per-token features (``draft_token_features``).

Policies:

- static: always γ (Leviathan et al.).
- heuristic: HF assisted generation — +2 after a fully accepted round, −1 otherwise, in [1, γ].
- confidence: HF's ``assistant_confidence_threshold`` — stop after a token whose draft
  probability is below ``lookahead.threshold`` (0.4).
- disco: seed 004 (DISCO) — a 2-layer FFN over Concat(top-k(p_D), Ent(p_D), i) gives the
  confidence that the token will be accepted; stop when it is below the threshold. Weights
  from ``lookahead.path`` (trained by ``python -m real.train.disco``).
- oracle: the upper bound — draft exactly as far as the target accepts: keep a token the
  target would accept, drop the first one it would reject. The caller says which (real: the
  target's greedy continuation at temperature 0; simulator: the oracle's acceptance).
- batch: γ by the number of requests in the round (``lookahead.by_batch``, e.g. ``1:4 4:2 8:0``:
  4 alone, 2 from four requests on, no speculation from eight), as serving engines turn
  speculation down and off with the batch size (vLLM's ``speculative_disable_by_batch_size``).
  The batched rounds of both backends tell every request's policy the round's batch size
  (``before_round``) before asking for its γ; served one at a time the batch is 1.

Features of a draft token (what real runs record into the trace, ``FEATURES`` floats): the
draft's top-10 probabilities, its entropy (nats) and the chosen token's probability, all under
the draft's raw softmax (temperature 1, no top-k/top-p), so they do not depend on sampling.
This module does not import torch at import time (the simulator's i.i.d. runs never load it).
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from testbed.registry import Registry

if TYPE_CHECKING:
    import torch

TOP_K = 10
FEATURES = TOP_K + 2  # top-k probabilities, entropy, chosen-token probability
ENTROPY, CHOSEN = TOP_K, TOP_K + 1  # indices in a feature vector
BLOCK = 64  # draft_token_features: the top-k is searched among the largest blocks of this size
NATIVE_MIN_VOCAB = 4096  # draft_token_features: the native kernel from this vocabulary size on
ONE_HOT_FEATURES = (1.0,) + (0.0,) * (TOP_K - 1) + (0.0, 1.0)  # a deterministic draft (n-gram)
CONFIDENCE_THRESHOLD = 0.4  # HF assisted generation's default assistant_confidence_threshold
DISCO_FORMAT = "specbed-disco-1"
TRAIN_HOWTO = "train one with `python -m real.train.disco` (or use the shipped models/disco/*.json)"


class Decision(enum.Enum):
    CONTINUE = "continue"  # keep this token, draft another (unless the window is full)
    STOP = "stop"  # keep this token, end the window
    DROP = "drop"  # the oracle: the target would reject this token; end the window without it


class ClassifierError(ValueError):
    """A missing or mismatched DISCO classifier file (reported on key lookahead.path)."""


def draft_token_features(logits: torch.Tensor, token: int, *, chosen_only: bool = False) -> list[float]:
    """The ``FEATURES`` floats of one draft token from the draft's logits ``[V]``.
    ``chosen_only``: the chosen token's probability alone (one pass over the vocabulary, for
    the confidence policy), the other entries NaN."""
    import torch

    native = _native_features(logits, token)
    if chosen_only:
        if native is not None:  # (its two passes: ~40 us, torch's logsumexp alone ~80)
            return [math.nan] * CHOSEN + [native[CHOSEN]]
        x = logits.float()
        return [math.nan] * CHOSEN + [math.exp(float(x[token] - torch.logsumexp(x, dim=-1)))]
    if native is not None:
        return native
    # Every drafted token of DISCO pays this: ~1 % of a bundled draft forward in the native kernel
    # (above), ~3.5 % here, where the ops' own dispatch (~5 us each) is most of it, so they are
    # few: one softmax (35 us, where torch.exp alone takes 55), the top-k from the k blocks of 64
    # with the largest maxima (they hold the k largest values), H = -log max p - sum(p z).
    x = logits.float().reshape(-1)
    p = torch.softmax(x, dim=-1)
    top = _top_values(p)
    x_max = float(x.max())
    # (with z = x - max x: sum(p z) is of the entropy's size, sum(p x) of the logits': in float32
    # the latter's rounding was 1e-4 of the entropy of a 49k-token distribution)
    entropy = -math.log(top[0]) - float(torch.dot(p, x - x_max)) if top[0] > 0 else math.nan
    if not math.isfinite(entropy):  # masked (-inf) logits: 0 * -inf; the exact terms instead
        z = (x - x_max).clamp_(min=-1e30)
        e = torch.exp(z)
        total = e.sum()
        entropy = float(torch.log(total) - torch.dot(e, z) / total)
    return [*top, *[0.0] * (TOP_K - len(top)), entropy, float(p[token])]


def _native_features(logits: torch.Tensor, token: int) -> list[float] | None:
    """The features from the native kernel, or None: no kernel (no compiler, SPECBED_NATIVE=0),
    not a CPU fp32 tensor, or a small vocabulary (the simulator's synthetic models: PyTorch's
    ops are fast enough there, and a simulation need not load the kernel library)."""
    if logits.numel() < NATIVE_MIN_VOCAB:
        return None
    from specbed_kernels import native

    return native.token_features(logits, token, TOP_K)


def _top_values(p: torch.Tensor) -> list[float]:
    """The min(TOP_K, V) largest values of ``p``, largest first."""
    import torch

    k = min(TOP_K, p.numel())
    if p.numel() % BLOCK == 0 and p.numel() >= BLOCK * TOP_K * 4:
        blocks = p.view(-1, BLOCK)
        return torch.topk(blocks[torch.topk(blocks.amax(dim=1), k).indices].reshape(-1), k).values.tolist()
    return torch.topk(p, k).values.tolist()


def window_features(rows: list[list[float]]) -> np.ndarray:
    """Classifier inputs for consecutive draft tokens: Concat(top-k, entropy, position i)."""
    x = np.asarray(rows, dtype=np.float32).reshape(-1, FEATURES)[:, :ENTROPY + 1]
    pos = np.arange(1, len(x) + 1, dtype=np.float32)[:, None]
    return np.concatenate([x, pos], axis=1)


@dataclass
class DiscoClassifier:
    """DISCO's 2-layer FFN: standardised inputs -> ReLU hidden layer -> sigmoid confidence."""

    mean: np.ndarray
    std: np.ndarray
    w1: np.ndarray  # [hidden, inputs]
    b1: np.ndarray
    w2: np.ndarray  # [hidden]
    b2: float
    threshold: float
    sl_max: int
    meta: dict = field(default_factory=dict)

    def confidence(self, x: np.ndarray) -> np.ndarray:
        """P(accepted) for classifier inputs ``x [n, TOP_K + 2]``."""
        h = np.maximum(((x - self.mean) / self.std) @ self.w1.T + self.b1, 0.0)
        z = h @ self.w2 + self.b2
        return 1.0 / (1.0 + np.exp(-z))

    def to_json(self) -> dict:
        return {"format": DISCO_FORMAT, "top_k": TOP_K, "inputs": TOP_K + 2,
                "mean": self.mean.tolist(), "std": self.std.tolist(), "w1": self.w1.tolist(),
                "b1": self.b1.tolist(), "w2": self.w2.tolist(), "b2": self.b2,
                "threshold": self.threshold, "sl_max": self.sl_max, **self.meta}


@lru_cache(maxsize=8)
def load_classifier(path: str, target: str = "") -> DiscoClassifier:
    """Read a classifier file; ClassifierError names what is wrong and how to get a good one.
    ``target``: the run's target model name; a file trained for another target is refused."""
    p = Path(path)
    if not p.is_file():
        raise ClassifierError(f"no such file; {TRAIN_HOWTO}")
    try:
        d = json.loads(p.read_text())
        if d.get("format") != DISCO_FORMAT or d.get("top_k") != TOP_K or d.get("inputs") != TOP_K + 2:
            raise ValueError(f"not a {DISCO_FORMAT} file with top_k={TOP_K}")
        w1 = np.asarray(d["w1"], dtype=np.float32)
        clf = DiscoClassifier(
            mean=np.asarray(d["mean"], dtype=np.float32), std=np.asarray(d["std"], dtype=np.float32),
            w1=w1, b1=np.asarray(d["b1"], dtype=np.float32), w2=np.asarray(d["w2"], dtype=np.float32),
            b2=float(d["b2"]), threshold=float(d["threshold"]), sl_max=int(d["sl_max"]),
            meta={k: d[k] for k in ("pair", "target", "draft", "trained") if k in d})
        n_in = TOP_K + 2
        if (w1.ndim != 2 or w1.shape[1] != n_in or clf.mean.shape != (n_in,) or clf.std.shape != (n_in,)
                or clf.b1.shape != (w1.shape[0],) or clf.w2.shape != (w1.shape[0],)):
            raise ValueError(f"weight shapes do not match a {n_in}-input 2-layer FFN")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ClassifierError(f"a readable DISCO classifier ({str(e)[:120]}); {TRAIN_HOWTO}") from None
    if target and clf.meta.get("target") not in (None, target):
        raise ClassifierError(f"a classifier trained for target {target!r} (this one is for "
                              f"{clf.meta.get('target')!r}); {TRAIN_HOWTO}")
    return clf


# ---------------------------------------------------------------------------------- policies
@dataclass
class LookaheadPolicy:
    """static: γ every round, never stops early."""

    gamma_max: int
    needs_features: bool = False  # after_token reads the features (else callers may pass none)
    needs_acceptance: bool = False  # after_token reads `accepted` (the oracle)
    chosen_only: bool = False  # of the features, after_token reads the chosen probability only
    per_token: bool = False  # after_token may end a window early

    def before_round(self, batch: int) -> None:  # noqa: B027 - optional hook
        """The requests of the round about to draft (the batched rounds call it; alone: 1)."""

    def next_gamma(self) -> int:
        return self.gamma_max

    def after_token(self, *, features: list[float] | tuple[float, ...] | None, position: int,
                    accepted: bool | None = None) -> Decision:
        """After draft token ``position`` (1-based) of the window."""
        return Decision.CONTINUE

    def observe(self, drafted: int, accepted: int) -> None:
        """Feedback after a verification."""


@dataclass
class HeuristicLookahead(LookaheadPolicy):
    current: int = 0

    def __post_init__(self) -> None:
        self.current = self.gamma_max

    def next_gamma(self) -> int:
        return self.current

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted and accepted == drafted:
            self.current = min(self.gamma_max, self.current + 2)
        else:
            self.current = max(1, self.current - 1)


@dataclass
class ConfidenceLookahead(LookaheadPolicy):
    threshold: float = CONFIDENCE_THRESHOLD

    def __post_init__(self) -> None:
        self.needs_features = self.per_token = self.chosen_only = True

    def after_token(self, *, features: list[float] | tuple[float, ...] | None, position: int,
                    accepted: bool | None = None) -> Decision:
        assert features is not None
        return Decision.STOP if features[CHOSEN] < self.threshold else Decision.CONTINUE


@dataclass
class DiscoLookahead(LookaheadPolicy):
    classifier: DiscoClassifier | None = None
    threshold: float = 0.5

    def __post_init__(self) -> None:
        self.needs_features = self.per_token = True
        c = self.classifier
        if c is not None:  # per token: the standardisation folded into the first layer, and the
            # confidence compared as a logit (sigmoid(z) < t  <=>  z < log(t / (1 - t)))
            self._w1 = (c.w1 / c.std[None, :]).astype(np.float32)
            self._b1 = (c.b1 - self._w1 @ c.mean).astype(np.float32)
            self._w2 = np.asarray(c.w2, dtype=np.float32)
            t = min(max(self.threshold, 1e-12), 1 - 1e-12)
            self._stop_below = math.log(t / (1 - t)) - float(c.b2)

    def after_token(self, *, features: list[float] | tuple[float, ...] | None, position: int,
                    accepted: bool | None = None) -> Decision:
        assert features is not None and self.classifier is not None
        x = np.asarray([*features[:ENTROPY + 1], float(position)], dtype=np.float32)
        z = float(np.maximum(self._w1 @ x + self._b1, 0.0) @ self._w2)
        return Decision.STOP if z < self._stop_below else Decision.CONTINUE


@dataclass
class OracleLookahead(LookaheadPolicy):
    """Keeps what the target accepts; ``reference`` (real, temperature 0): the target's greedy
    sequence (prompt + continuation), set per request; ``would_accept`` reads it."""

    reference: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.needs_acceptance = self.per_token = True

    def would_accept(self, slot: int, token: int) -> bool:
        return slot < len(self.reference) and self.reference[slot] == token

    def after_token(self, *, features: list[float] | tuple[float, ...] | None, position: int,
                    accepted: bool | None = None) -> Decision:
        assert accepted is not None, "the oracle policy needs the target's verdict"
        return Decision.CONTINUE if accepted else Decision.DROP


DEFAULT_BY_BATCH = "1:4 2:2 4:1 8:0"  # conf/lookahead/batch.yaml's


def parse_by_batch(text: str) -> list[tuple[int, int]]:
    """``'B:γ B:γ ...'`` (or comma-separated) as ``[(B, γ), ...]``: B ascending from 1 or more,
    γ >= 0; ValueError otherwise."""
    rule: list[tuple[int, int]] = []
    for part in str(text).replace(",", " ").split():
        try:
            b, g = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not B:γ (two integers)") from None
        if b < 1 or g < 0 or (rule and b <= rule[-1][0]):
            raise ValueError(f"{b}:{g}: batch sizes ascend from 1 or more, γ >= 0")
        rule.append((b, g))
    if not rule:
        raise ValueError("no B:γ pair")
    return rule


@dataclass
class BatchLookahead(LookaheadPolicy):
    """γ by the round's batch size: the rule's γ of the largest listed size <= the batch (the
    cap below the smallest), capped at ``gamma_max``."""

    rule: list[tuple[int, int]] = field(default_factory=lambda: parse_by_batch(DEFAULT_BY_BATCH))
    batch: int = 1

    def before_round(self, batch: int) -> None:
        self.batch = batch

    def next_gamma(self) -> int:
        gamma = self.gamma_max
        for size, g in self.rule:
            if size <= self.batch:
                gamma = g
        return min(gamma, self.gamma_max)


@dataclass(frozen=True)
class PolicyKind:
    """A lookahead policy's entry in ``LOOKAHEADS``: its factory ``make(gamma_max, threshold,
    classifier)`` and whether it decides after every token (runs in the sync chain only)."""

    make: Callable[[int, float | None, DiscoClassifier | None], LookaheadPolicy]
    per_token: bool = False


def _disco(gamma_max: int, threshold: float | None, classifier: DiscoClassifier | None) -> LookaheadPolicy:
    if classifier is None:
        raise ValueError("lookahead=disco needs its classifier (lookahead.path)")
    return DiscoLookahead(gamma_max, classifier=classifier,
                          threshold=classifier.threshold if threshold is None else threshold)


LOOKAHEADS: Registry[PolicyKind] = Registry("lookahead")
LOOKAHEADS.register("static", PolicyKind(lambda g, t, c: LookaheadPolicy(g)))
LOOKAHEADS.register("heuristic", PolicyKind(lambda g, t, c: HeuristicLookahead(g)))
LOOKAHEADS.register("confidence", PolicyKind(lambda g, t, c: ConfidenceLookahead(
    g, threshold=CONFIDENCE_THRESHOLD if t is None else t), per_token=True))
LOOKAHEADS.register("disco", PolicyKind(_disco, per_token=True))
LOOKAHEADS.register("oracle", PolicyKind(lambda g, t, c: OracleLookahead(g), per_token=True))
LOOKAHEADS.register("batch", PolicyKind(lambda g, t, c: BatchLookahead(g)))
POLICIES = LOOKAHEADS.names()
PER_TOKEN = tuple(n for n, k in LOOKAHEADS.items() if k.per_token)  # policies that decide after every token


def make_lookahead(policy: str, gamma_max: int, *, threshold: float | None = None,
                   classifier: DiscoClassifier | None = None) -> LookaheadPolicy:
    try:
        kind = LOOKAHEADS.get(policy)
    except KeyError:
        raise ValueError(f"lookahead={policy!r}: allowed {', '.join(POLICIES)}") from None
    return kind.make(gamma_max, threshold, classifier)


def lookahead_for(exp: object) -> LookaheadPolicy:
    """The run's policy from ``exp.lookahead`` and ``exp.schedule.gamma`` (both backends)."""
    la, gamma = exp.lookahead, exp.schedule.gamma  # type: ignore[attr-defined]
    clf = None
    if la.policy == "disco":
        # a file trained for another target is refused on real; the simulator models a pair
        target = exp.pair.target.name if exp.backend == "real" else ""  # type: ignore[attr-defined]
        clf = load_classifier(str(resolve_path(la.path)), target)
    if la.policy == "batch":
        return BatchLookahead(gamma, rule=parse_by_batch(la.by_batch or DEFAULT_BY_BATCH))
    return make_lookahead(la.policy, gamma, threshold=la.threshold, classifier=clf)


def resolve_path(path: str | None) -> Path:
    from testbed.paths import repo_path

    return repo_path(path or "")
