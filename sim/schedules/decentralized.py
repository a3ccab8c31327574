"""`decentralized`: DSD (seed 003) — a draft window verified per pipeline round trip.

The target is a pipeline of ``placement.nodes`` stages on as many nodes, joined by the links of
``network=`` (sim.runtime.pipeline, sim.runtime.topology); the draft runs on the first node. One round:

1. the draft proposes γ tokens on node 0 (γ forwards, as in `sync`);
2. the γ+1 tokens go through the pipeline: stage i computes its layers and sends
   (γ+1) x hidden activations to stage i+1;
3. the last stage verifies — Algorithm 1 (testbed.spec.speculative via the oracle), or DSD's
   adaptive rule (testbed.spec.dsd: key tokens strict, others against P_t^(1-τ)·P_d^τ) when
   ``schedule.adaptive=true`` — and returns the accepted tokens plus one to node 0 (an eagle
   draft's features of the old root and the accepted tokens with them).

An eagle draft reads the target's features: the last stage sends the prompt's back after the
prefill, and the draft's prefill and first window wait for them (real/schedules/decentralized.py).

With the i.i.d. oracle the acceptance is Leviathan's model through the shared rule; the adaptive
rule needs token distributions (acceptance=synthetic; config validation says so).

Theory. Per round the pipeline costs t0 (compute of all stages) + L·t1 (L links crossed), and
the draft γ·c·t0, so against `ar` over the same pipeline (t0 + L·t1 per token)

    speedup = E·(t0 + L·t1) / (γ·c·t0 + t0 + L·t1),    E = (1 − α^(γ+1)) / (1 − α).

DSD writes (N−1)·t1 for the communication of one synchronization; the closed loop simulated here
(activations stage to stage, tokens back to the draft's node) crosses L = N links. ``theory``
evaluates the formula with the run's L (``dsd_speedup(..., nodes=L+1)``) and, for comparison,
with the paper's N−1 (``theory_speedup_open_chain``).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import torch

from sim.oracle.base import ChainOutcome, SequenceOracle
from sim.oracle.synthetic import SyntheticSequence
from sim.runtime.context import SimContext, SimRequest
from sim.runtime.pipeline import Pipeline
from sim.schedules import register
from testbed.links import draft_dists_bytes
from testbed.recorder import RequestRecord
from testbed.spec.dsd import dsd_verify
from testbed.spec.lookahead import make_lookahead
from testbed.spec.sampling import sample
from testbed.theory import dsd_comm_reduction, dsd_speedup


def adaptive_round(seq: SequenceOracle, gamma: int, tau: float, lambdas: tuple[float, float, float],
                   ) -> tuple[ChainOutcome, list[bool]]:
    """One DSD window on the synthetic oracle: draft γ tokens from q exactly as
    ``SyntheticSequence.chain_round`` does (same random stream), verify with ``dsd_verify``.
    At τ = 0 this is token for token ``chain_round`` (DSD's rule reduces to Algorithm 1)."""
    if not isinstance(seq, SyntheticSequence):
        raise ValueError("schedule.adaptive=true needs token distributions: use acceptance=synthetic")
    lm, ctx_tokens, gen = seq.lm, seq.tokens, seq.gen
    guesses: list[int] = []
    ps, qs = [], []
    for _ in range(gamma):
        p, q = lm.dists((ctx_tokens + guesses)[-2:])
        guesses.append(sample(q, gen))
        ps.append(p)
        qs.append(q)
    ps.append(lm.dists((ctx_tokens + guesses)[-2:])[0])
    lambda1, lambda2, lambda3 = lambdas
    res = dsd_verify(torch.stack(ps), torch.stack(qs), torch.tensor(guesses, dtype=torch.long),
                     tau, lambda1=lambda1, lambda2=lambda2, lambda3=lambda3, generator=gen)
    seq.tokens.extend(res.step.tokens)
    return ChainOutcome(res.step.accepted, res.step.tokens, res.step.ratios), res.key


def closed_loop_speedup(alpha: float, gamma: int, *, c: float, t0: float, t1: float, links: int) -> float:
    """DSD's speedup formula with its communication term set to `links` x t1."""
    return dsd_speedup(alpha, gamma, c=c, t0=t0, t1=t1, nodes=links + 1)


def _summary(ctx: SimContext, pipe: Pipeline, acc: dict[str, float]) -> dict[str, Any]:
    exp, s = ctx.exp, ctx.exp.schedule
    t0 = acc["t0_s"]
    t1 = pipe.hop_mean_s(1)
    links = pipe.links_per_round_trip
    k = (acc["accepted"] + acc["rounds"]) / acc["rounds"] if acc["rounds"] else float("nan")
    out: dict[str, Any] = {
        **pipe.summary_fields(),
        "adaptive": s.adaptive, "tau": s.tau if s.adaptive else 0.0,
        "t0_ms": 1e3 * t0, "t1_ms": 1e3 * t1,
        # DSD eq. (5) with the measured mean accepted length k and the loop's L·t1
        "comm_reduction_eq5": dsd_comm_reduction(k, t0, t1, links + 1) if k == k else None,
        "key_token_fraction": acc["key"] / acc["drafted"]
        if s.adaptive and acc["drafted"] and exp.acceptance.oracle == "synthetic" else None,
        "theory_speedup": None, "theory_speedup_open_chain": None,
    }
    if exp.sim.cost_model == "analytic" and exp.acceptance.oracle == "iid" and exp.lookahead.policy == "static":
        a, c = exp.acceptance.alpha, exp.sim.c
        out["theory_speedup"] = closed_loop_speedup(a, s.gamma, c=c, t0=t0, t1=t1, links=links)
        out["theory_speedup_open_chain"] = dsd_speedup(a, s.gamma, c=c, t0=t0, t1=t1, nodes=pipe.nodes)
    return {k_: (None if isinstance(v, float) and not math.isfinite(v) else v) for k_, v in out.items()}


@register("decentralized")
def decentralized(ctx: SimContext, req: SimRequest) -> Generator[Any, Any, None]:
    env, cost, rec, exp = ctx.env, ctx.cost, ctx.rec, ctx.exp
    s = exp.schedule
    pipe = Pipeline.of(ctx)
    seq = ctx.oracle.sequence(req.request_id, req.prompt_len)
    policy = make_lookahead(exp.lookahead.policy, s.gamma)
    lambdas = (s.lambda1, s.lambda2, s.lambda3)
    acc = ctx.state.setdefault("dsd", {"rounds": 0, "accepted": 0, "drafted": 0, "key": 0,
                                       "t0_s": pipe.compute_s(1, req.prompt_len)})
    rid = req.request_id
    t_start = env.now
    pf_draft = cost.prefill("draft", req.prompt_len)  # the draft shares node 0's GPUs
    if not pipe.back_features:
        s_draft = yield from pipe.on_stage(0, pf_draft)
        rec.span("draft", "prefill", s_draft, env.now, request_id=rid)
    yield from pipe.forward(req.prompt_len, 0, rid, -1, kind="prefill")
    if pipe.back_features:  # an eagle head's prefill reads the prompt's features
        yield from pipe.send_prompt_answer(req.prompt_len - 1, rid)
        s_draft = yield from pipe.on_stage(0, pf_draft)
        rec.span("draft", "prefill", s_draft, env.now, request_id=rid)
    prefill_s = env.now - t_start
    start = env.now
    seq_len = req.prompt_len
    pending = 1  # tokens the draft must feed before its first guess (see sync.py)
    generated, r = 0, 0
    out: list[int] = []
    n_max = req.max_new_tokens
    # a sampled model draft's q travels with the window (real/schedules/decentralized.py)
    sends_q = exp.sampling.temperature > 0 and exp.pair.draft.kind in ("transformer", "eagle")
    while generated < n_max:
        gamma = policy.next_gamma()
        t_round = env.now
        draft_s = cost.draft_chain(pending, gamma, seq_len)
        q_bytes = draft_dists_bytes(gamma, vocab=exp.pair.target.vocab, topk=s.draft_topk) if sends_q else 0
        # the draft shares node 0's devices: it drafts, then stage 0 runs the window
        target_s = yield from pipe.forward(gamma + 1, seq_len - 1, rid, r, kind="verify", dists_bytes=q_bytes,
                                           draft_s=draft_s)
        if s.adaptive and isinstance(seq, SyntheticSequence):  # a trace replays the rule's outcomes
            outcome, key = adaptive_round(seq, gamma, s.tau, lambdas)
            acc["key"] += sum(key)
        else:
            outcome = seq.chain_round(gamma)
        n = outcome.accepted
        yield from pipe.send_back(n + 1, rid, r)
        emitted = min(n + 1, n_max - generated)
        out.extend(outcome.tokens[:emitted])
        generated += emitted
        seq_len += n + 1
        pending = 2 if n == gamma else 1
        policy.observe(gamma, n)
        rec.round(request_id=rid, round_idx=r, start_s=t_round, end_s=env.now, drafted=gamma,
                  checked=n + (n < gamma), accepted=n, emitted=emitted, verified_tokens=gamma + 1,
                  draft_s=draft_s, target_s=target_s)
        acc["rounds"] += 1
        acc["accepted"] += n
        acc["drafted"] += gamma
        r += 1
    rec.request(RequestRecord(request_id=rid, prompt_id=req.prompt_id, prompt_len=req.prompt_len,
        output_ids=out, generated=generated, prefill_s=prefill_s, decode_s=env.now - start, rounds=r))
    ctx.extra.update(_summary(ctx, pipe, acc))
