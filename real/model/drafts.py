"""Drafts of the real backend: a small model, the target's first layers, or prompt lookup.

Every draft proposes up to γ guesses for the sequence ``ids`` and the distributions ``q`` they
were drawn from; the target then verifies with testbed.spec.speculative (Algorithm 1). Draft
caches follow the sync schedule of sim/schedules/sync.py: the first forward of a round feeds the
tokens the draft has not seen yet (the previous bonus, plus the last guess after a fully
accepted round), the following γ−1 forwards feed one guess each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from real.model.batch import CacheRows, Feed, forward_batch
from real.model.decoder import Transformer
from real.model.runners import chain_logits, prefill
from testbed.spec.lookahead import ONE_HOT_FEATURES, Decision, LookaheadPolicy, draft_token_features
from testbed.spec.ngram import ngram_lookup
from testbed.spec.sampling import SamplingParams, sample, standardize


def one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    """q for a deterministic draft: every guess has probability 1 (Algorithm 1 then accepts
    x with probability p(x) and resamples from norm(max(p − q, 0)) — still lossless)."""
    q = torch.zeros(len(tokens), vocab)
    if tokens:
        q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return q


class Draft(ABC):
    name: str = "draft"
    # lookahead (testbed/spec/lookahead.py): per-token features of the last window's tokens
    # (recorded into the trace; with a dropped token last) and how many the oracle dropped
    last_features: list[list[float]]
    last_dropped: int = 0
    # compute features even when the policy does not read them (runs that feed traces; the
    # top-10 and entropy over the vocabulary cost a share of a small draft's forward)
    record_features: bool = False

    def start(self, prompt_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """Per request, after the target's prefill."""

    @abstractmethod
    def propose(self, ids: list[int], gamma: int, gen: torch.Generator | None,
                policy: LookaheadPolicy | None = None) -> tuple[list[int], torch.Tensor]:
        """Up to ``gamma`` guesses continuing ``ids`` and their distributions ``q [n, V]``;
        ``policy`` decides after every guess whether to go on (lookahead)."""

    def commit(self, ids: list[int], accepted: int, proposed: int) -> None:  # noqa: B027
        """After verification: ``ids`` is the new sequence (``accepted`` guesses + one token)."""

    def forward_probs(self, tokens: list[int], start: int) -> torch.Tensor | None:
        """One draft forward feeding ``tokens`` at slot ``start`` (calibration); None if the
        draft has no model."""
        return None


class _ForwardDraft(Draft):
    """A draft that runs a model forward per guess (its own model, or the target's layers)."""

    def __init__(self, params: SamplingParams, vocab: int) -> None:
        self.params, self.vocab = params, vocab
        self.cached = 0  # tokens of the sequence whose K/V the draft holds (slots 0..cached-1)
        self._base = 0

    @abstractmethod
    def _logits(self, tokens: list[int], start: int) -> torch.Tensor:
        """fp32 logits of the last fed token ``[V]``."""

    @torch.inference_mode()
    def forward_probs(self, tokens: list[int], start: int) -> torch.Tensor:
        return standardize(self._logits(tokens, start), self.params)

    @torch.inference_mode()
    def propose(self, ids: list[int], gamma: int, gen: torch.Generator | None,
                policy: LookaheadPolicy | None = None) -> tuple[list[int], torch.Tensor]:
        window = ChainWindow(self, ids, gamma, gen, policy)
        while (feed := window.next_feed()) is not None:
            window.take(self._logits(*feed))
        return window.result()

    def commit(self, ids: list[int], accepted: int, proposed: int) -> None:
        # the last guess was never fed; accepted guesses beyond the cached ones are pending
        self.cached = min(self.cached, self._base + accepted) if proposed else self.cached


class ChainWindow:
    """One window of a forward draft, a forward at a time: ``next_feed`` says what the next
    forward feeds (tokens, first slot), ``take`` gives it that forward's logits of the last fed
    token, ``result`` ends the window. ``_ForwardDraft.propose`` drives one; the batched rounds
    (real/runtime/batching.py) drive one per request and serve all their feeds in one forward."""

    def __init__(self, draft: _ForwardDraft, ids: list[int], gamma: int, gen: torch.Generator | None,
                 policy: LookaheadPolicy | None) -> None:
        self.draft, self.ids, self.gamma, self.gen, self.policy = draft, ids, gamma, gen, policy
        self.feed, self.pos = ids[draft.cached:], draft.cached
        draft._base = len(ids)
        self.guesses: list[int] = []
        self.qs: list[torch.Tensor] = []
        draft.last_features, draft.last_dropped = [], 0
        self.want = draft.record_features or (policy is not None and policy.needs_features)
        self.cheap = not draft.record_features and policy is not None and policy.chosen_only
        self.done = gamma < 1

    def next_feed(self) -> tuple[list[int], int] | None:
        return None if self.done else (self.feed, self.pos)

    def take(self, logits: torch.Tensor) -> None:
        d, i = self.draft, len(self.guesses)
        q = standardize(logits, d.params)
        t = int(q.argmax()) if d.params.greedy else sample(q, self.gen)
        feats = draft_token_features(logits, t, chosen_only=self.cheap) if self.want else None
        if feats is not None:
            d.last_features.append(feats)
        self.pos += len(self.feed)
        self.feed = [t]
        decision = _decide(self.policy, feats, position=i + 1, slot=len(self.ids) + i, token=t)
        if decision is Decision.DROP:
            d.last_dropped = 1
            self.done = True
            return
        self.guesses.append(t)
        self.qs.append(q)
        self.done = decision is Decision.STOP or len(self.guesses) >= self.gamma

    def result(self) -> tuple[list[int], torch.Tensor]:
        # ids plus every guess but the last were fed (a dropped guess never was)
        self.draft.cached = self.pos
        return self.guesses, torch.stack(self.qs) if self.qs else torch.zeros(0, self.draft.vocab)


class ModelDraft(_ForwardDraft):
    """A small model sharing the target's tokenizer, with its own KV cache."""

    def __init__(self, model: Transformer, params: SamplingParams, name: str) -> None:
        super().__init__(params, model.args.vocab_size)
        self.model, self.name = model, name

    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        prefill(self.model, prompt_ids[:-1])
        self.cached = len(prompt_ids) - 1

    def _logits(self, tokens: list[int], start: int) -> torch.Tensor:
        if self.model.graph_forwards is not None:
            return chain_logits(self.model, tokens, start)[-1]
        x = torch.tensor([tokens], device=self.model.device)
        h = self.model.forward_layers(self.model.embed(x), start)
        return self.model.head(h[:, -1:])[0, -1]


class RowModelDraft(ModelDraft):
    """A draft model's state for one of several requests in flight whose windows are drafted one
    at a time (a pipeline's first stage under load, real/runtime/pipelined.py): the request's own
    row of the draft's KV cache, the model shared. Its logits equal the one-request draft's
    (real/model/batch.py: a row computes the same whatever row it is)."""

    def __init__(self, model: Transformer, params: SamplingParams, name: str, *, rows: CacheRows,
                 row: int) -> None:
        super().__init__(model, params, name)
        self.rows, self.row = rows, row

    @torch.inference_mode()
    def start(self, prompt_ids: list[int]) -> None:
        self.rows.prefill(self.row, prompt_ids[:-1])
        self.cached = len(prompt_ids) - 1

    def _logits(self, tokens: list[int], start: int) -> torch.Tensor:
        return forward_batch(self.model, [Feed(self.row, tokens, start)])[0][-1]


class EarlyExitDraft(_ForwardDraft):
    """The target's first ``exit_layer`` layers + its final norm and LM head (self-speculation).

    It shares the target's KV cache: the K/V it writes for layers < exit_layer are exactly what
    the target writes for the same tokens at the same slots, and the verification forward
    rewrites every slot a guess used, so nothing needs undoing after a rejection.
    """

    def __init__(self, target: Transformer, exit_layer: int, params: SamplingParams) -> None:
        super().__init__(params, target.args.vocab_size)
        self.target, self.exit_layer = target, exit_layer
        self.name = f"early_exit{exit_layer}"

    def start(self, prompt_ids: list[int]) -> None:
        self.cached = len(prompt_ids) - 1  # the target's prefill filled these slots

    def commit(self, ids: list[int], accepted: int, proposed: int) -> None:
        self.cached = len(ids) - 1  # the target's verification rewrote every slot but the bonus

    def _logits(self, tokens: list[int], start: int) -> torch.Tensor:
        x = torch.tensor([tokens], device=self.target.device)
        h = self.target.forward_layers(self.target.embed(x), start, lo=0, hi=self.exit_layer)
        return self.target.head(h[:, -1:])[0, -1]


class NgramDraft(Draft):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n = ngram down to 1) and propose the tokens that followed it. No model; q is one-hot."""

    def __init__(self, ngram: int, vocab: int) -> None:
        self.ngram, self.vocab = ngram, vocab
        self.name = f"ngram{ngram}"

    def lookup(self, ids: list[int], gamma: int) -> list[int]:
        return ngram_lookup(ids, ngram=self.ngram, gamma=gamma)

    def propose(self, ids: list[int], gamma: int, gen: torch.Generator | None,
                policy: LookaheadPolicy | None = None) -> tuple[list[int], torch.Tensor]:
        found = self.lookup(ids, gamma)
        self.last_features, self.last_dropped = [], 0
        guesses: list[int] = []
        for i, t in enumerate(found):
            # one-hot q: DISCO sees only the position, confidence never stops (p = 1)
            self.last_features.append(list(ONE_HOT_FEATURES))
            decision = _decide(policy, ONE_HOT_FEATURES, position=i + 1, slot=len(ids) + i, token=t)
            if decision is Decision.DROP:
                self.last_dropped = 1
                break
            guesses.append(t)
            if decision is Decision.STOP:
                break
        return guesses, one_hot(guesses, self.vocab)


def _decide(policy: LookaheadPolicy | None, features: list[float] | tuple[float, ...] | None,
            *, position: int, slot: int, token: int) -> Decision:
    """The lookahead decision after draft token ``position`` of a window (at sequence ``slot``)."""
    if policy is None or not policy.per_token:
        return Decision.CONTINUE
    accepted = policy.would_accept(slot, token) if policy.needs_acceptance else None  # type: ignore[attr-defined]
    return policy.after_token(features=features, position=position, accepted=accepted)
