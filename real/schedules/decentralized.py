"""`decentralized` on real models: DSD (seed 003) — a draft window verified per pipeline round trip.

The mirror of sim/schedules/decentralized.py. The target is split into ``placement.nodes`` stage
processes (real/runtime/pipeline.py, the split of testbed.placement), joined in a ring by emulated
``network=`` links; the draft runs on the first stage's process. One round:

1. the first stage's draft proposes γ tokens (as in `sync`);
2. the γ+1 tokens go through the pipeline (``real.runtime.pipeline.traverse``): each stage runs its
   layers, the hidden states and the window (tokens, and the draft distributions when the
   verifier needs them) travel to the next stage;
3. the last stage verifies (``WindowVerifier``: Algorithm 1, testbed.spec.speculative, or DSD's
   adaptive rule, testbed.spec.dsd, when ``schedule.adaptive=true``) and returns the accepted
   tokens plus one to the first stage.

An eagle head (real/model/eagle.py) reads the target's features, which only the last stage
computes: the last stage returns them with its answers (``Stage.features``) — the fed prompt's
with the prompt's acknowledgement, the old root's and the accepted guesses' with the verified
tokens, the rows `sync` hands over in one process — and the first stage gives them to the head
(``EagleDraft.start`` / ``commit`` with ``features=``). Its first window waits for the prompt's.
The head drafts through the target's embedding, final norm and LM head, which the first stage
holds (real/runtime/pipeline.py).

Draft distributions on the wire. At temperature 0 (and for the one-hot n-gram draft) the
verifier rebuilds q from the window's tokens: nothing is sent. Otherwise q travels with the
window. Full rows cost γ·V·4 bytes (1.5 MB per window for SmolLM2's 49k vocabulary at γ = 8,
12 ms per hop at 1 Gb/s), so by default the draft *samples from its top-k*
(``schedule.draft_topk`` = 64: its top-k-filtered distribution, testbed.spec.sampling) and the
window carries those k values (fp32) and indices (int32) per guess: 8·k bytes, 4 KiB per window.
The verifier rebuilds exactly the q the guesses were drawn from, so Algorithm 1 — and DSD's rule
at τ = 0 — stays exactly lossless; the price is a draft whose tail is cut (a slightly lower
acceptance), not a biased output. ``schedule.draft_topk=0`` sends the full rows.
``testbed.links.draft_dists_bytes`` is the size both backends charge.

Quality. The last stage also records the target's negative log-likelihood of every emitted
token from the logits it verified with (temperature 1, no extra forward): ``target_nll_per_token``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from real.model.drafts import Draft, one_hot
from real.model.eagle import EagleDraft
from real.runtime.context import RealRequest, finish
from real.runtime.links import Message
from real.runtime.pipeline import (
    SCHEDULE_PHASE,
    Flow,
    Stage,
    Verify,
    await_prompt,
    pack_dists,
    run_alone,
    send_prompt,
    traverse,
    unpack_dists,
)
from real.schedules import register
from testbed.recorder import RequestRecord, RunRecorder
from testbed.schedules import spec_of
from testbed.spec.dsd import dsd_verify
from testbed.spec.lookahead import make_lookahead
from testbed.spec.sampling import SamplingParams, standardize
from testbed.spec.speculative import speculative_step

TARGET_SALT, DRAFT_SALT = 0, 500_000_017  # independent sampling streams of last and first stage


def stream(seed: int, request_id: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + request_id + salt)


def sends_dists(params: SamplingParams, draft: Draft | None) -> bool:
    """Whether q must travel: only a sampled draft's q cannot be rebuilt from its tokens."""
    from real.model.drafts import NgramDraft

    return not params.greedy and draft is not None and not isinstance(draft, NgramDraft)


@dataclass
class WindowVerifier:
    """The last stage's decision on one request's windows (``real.runtime.pipeline.Verify``)."""

    params: SamplingParams
    vocab: int
    gen: torch.Generator
    adaptive: bool = False
    tau: float = 0.0
    lambdas: tuple[float, float, float] = (1.5, 0.3, 0.5)
    nll: list[float] = field(default_factory=list)  # per emitted token, target at temperature 1
    key: int = 0  # drafted tokens DSD verified strictly (adaptive)
    drafted: int = 0

    def __call__(self, logits: torch.Tensor, msg: Message) -> list[int]:
        tokens = msg.tensors[1].long()
        guesses = tokens[1:]
        p = standardize(logits, self.params)
        q = unpack_dists(msg.tensors[2:], self.vocab) if len(msg.tensors) > 2 \
            else one_hot(guesses.tolist(), self.vocab)
        if self.adaptive:
            lambda1, lambda2, lambda3 = self.lambdas
            res = dsd_verify(p, q, guesses, self.tau, lambda1=lambda1, lambda2=lambda2, lambda3=lambda3,
                             generator=self.gen)
            step = res.step
            self.key += sum(res.key)
        else:
            step = speculative_step(p, q, draft_tokens=guesses, generator=self.gen)
        self.drafted += int(guesses.numel())
        emitted = step.tokens
        logp = torch.log_softmax(logits[:len(emitted)].float(), dim=-1)
        self.nll.extend((-logp.gather(-1, torch.tensor(emitted).view(-1, 1))).flatten().tolist())
        return emitted


def make_verifier(exp, vocab: int, request_id: int, *, baseline: bool) -> WindowVerifier:  # type: ignore[no-untyped-def]
    s, sp = exp.schedule, exp.sampling
    params = SamplingParams(sp.temperature, sp.top_k, sp.top_p)
    adaptive = "schedule.adaptive" in spec_of(exp).reads and s.adaptive and not baseline
    return WindowVerifier(params, vocab, stream(exp.seed, request_id, TARGET_SALT), adaptive=adaptive,
                          tau=s.tau if adaptive else 0.0, lambdas=(s.lambda1, s.lambda2, s.lambda3))


def dsd_first_stage(stage: Stage, draft: Draft, req: RealRequest, eos: frozenset[int], *,
                    exp, rec: RunRecorder, send_dists: bool,  # type: ignore[no-untyped-def]
                    verify: Verify | None = None,
                    on_tokens: Callable[[int], None] = lambda n: None) -> list[int]:
    """DSD for one request served alone (``dsd_flow``)."""
    return run_alone(stage, dsd_flow(stage, draft, req, eos, exp=exp, rec=rec, send_dists=send_dists,
                                     verify=verify, on_tokens=on_tokens))


def dsd_flow(stage: Stage, draft: Draft, req: RealRequest, eos: frozenset[int], *,
             exp, rec: RunRecorder, send_dists: bool,  # type: ignore[no-untyped-def]
             verify: Verify | None = None, on_tokens: Callable[[int], None] = lambda n: None,
             row: int = 0) -> Flow[list[int]]:
    """DSD, first stage's side, for one request on KV-cache row ``row`` (``draft``: its own
    draft state): draft a window, send it round the pipeline, take the verified tokens back;
    records the rounds and the request (the simulator's ``decentralized`` records the same)."""
    rid, now = req.request_id, stage.now
    policy = make_lookahead(exp.lookahead.policy, exp.schedule.gamma)
    gen = stream(exp.seed, rid, DRAFT_SALT)
    ids = list(req.prompt_ids)
    t0 = now()
    send_prompt(stage, ids[:-1], rid, SCHEDULE_PHASE, row)
    if not isinstance(draft, EagleDraft):  # an eagle head waits for the prompt's features
        s = now()
        draft.start(ids)  # overlaps the other stages' prefill
        rec.span("draft", "prefill", s, now(), request_id=rid)
    prefill_end, features = yield from await_prompt(stage, rid)
    if isinstance(draft, EagleDraft):
        s = now()
        draft.start(ids, features=features)  # the prompt's features: after the acknowledgement
        rec.span("draft", "prefill", s, now(), request_id=rid)
    prefill_end = max(prefill_end, now())
    start = now()
    out: list[int] = []
    done, r = False, 0
    while not done:
        gamma = policy.next_gamma()
        s = now()
        guesses, q = draft.propose(ids, gamma, gen)
        m = now()
        dists = pack_dists(q, exp.schedule.draft_topk) if send_dists and guesses else ()
        emitted, features = yield from traverse(stage, [ids[-1], *guesses], committed=len(ids),
                                                request_id=rid, round_idx=r, phase=SCHEDULE_PHASE,
                                                dists=dists, verify=verify, row=row)
        e = now()
        n, k = len(emitted) - 1, len(guesses)
        ids.extend(emitted)
        if isinstance(draft, EagleDraft):
            draft.commit(ids, n, k, features=features)
        else:
            draft.commit(ids, n, k)
        before = len(out)
        out, done = finish(out, emitted, req.max_new_tokens, eos)
        policy.observe(k, n)
        rec.round(request_id=rid, round_idx=r, start_s=s, end_s=e, drafted=k, checked=n + (n < k),
                  accepted=n, emitted=len(out) - before, verified_tokens=k + 1, draft_s=m - s,
                  target_s=e - m)
        rec.span("draft", "draft", s, m, request_id=rid, round_idx=r)
        on_tokens(len(out) - before)
        r += 1
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=len(req.prompt_ids),
        output_ids=out, generated=len(out), prefill_s=prefill_end - t0, decode_s=now() - start, rounds=r))
    return out


# --------------------------------------------------------------------------- theory
def alpha_from_tokens(tokens_per_round: float, gamma: int) -> float:
    """The α whose Leviathan eq. (1) gives ``tokens_per_round`` (bisection; the measured α of
    DSD's eq. 9)."""
    from testbed.theory import expected_tokens

    if not math.isfinite(tokens_per_round) or tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round >= gamma + 1:
        return 1.0
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < tokens_per_round else (lo, mid)
    return (lo + hi) / 2


# the registry's entry: the first stage's flow of one request, run by the pipeline layout's
# runner (real/runtime/pipeline_run.py)
register("decentralized", dsd_flow)
