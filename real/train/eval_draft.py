"""Evaluate a draft against the bundled target on held-out prompts (issue 5).

    python -m real.train.eval_draft                       # conf/eval_draft.yaml
    python -m real.train.eval_draft num_prompts=10 draft=models/smollm2-draft

For each workload's ``holdout`` split: the target generates a continuation of each prompt
(greedy for T0, sampled at T=1 for T1); then both models are teacher-forced over
prompt + continuation and, at every continuation position,

* α_T0 = β of the one-hot (argmax) distributions = [draft argmax == target argmax];
* α_T1 = β = Σ_x min(p(x), q(x)) at temperature 1 (Leviathan's α);
* the sync schedule's accepted length at T0 for γ: a round at position i proposes the draft's
  argmaxes at i..i+γ-1 (teacher-forced = what the draft would propose, since every accepted
  guess equals the target's token), Algorithm 1's ``accepted_prefix`` keeps the agreeing run,
  and the next round starts after the correction/bonus token (i + n + 1). Only rounds with a
  full window of γ positions are counted.

Both β values come from testbed.spec (standardize, expected_acceptance, accepted_prefix).
The cost ratio c = t_draft / t_target is the median time of one batch-1 decode forward (one
token after ``timing.context`` tokens of context), the two models' calls interleaved.
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from real.model.eagle import (
    EagleDraft,
    EagleHead,
    chain_accepted,
    forced_logits,
    is_eagle_dir,
    load_head,
)
from real.train.draft_data import generate_batch
from testbed.paths import ROOT, repo_path
from testbed.spec.sampling import SamplingParams, standardize
from testbed.spec.speculative import acceptance_ratios, accepted_prefix, expected_acceptance

T0, T1 = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)


def sync_accepted_lengths(target_tokens: torch.Tensor, draft_tokens: torch.Tensor,
                          gamma: int) -> list[int]:
    """Accepted guesses per T0 sync round from teacher-forced argmaxes ``[m]`` of both models.

    Round at i: guesses = draft argmaxes i..i+γ-1; their Algorithm-1 ratios p(x)/q(x) under
    one-hot p and q are 1 (agree) or 0 (disagree); with r = 1 (any r in (0, 1]) the accepted
    prefix is the run of agreements. The round emits n + 1 tokens, so the next starts at
    i + n + 1."""
    m, out, i = len(target_tokens), [], 0
    vocab = int(max(target_tokens.max(), draft_tokens.max())) + 1
    while i + gamma <= m:
        p = torch.nn.functional.one_hot(target_tokens[i: i + gamma], vocab).float()
        q = torch.nn.functional.one_hot(draft_tokens[i: i + gamma], vocab).float()
        ratios = acceptance_ratios(p, q, draft_tokens[i: i + gamma]).tolist()
        n = accepted_prefix(ratios, [1.0] * gamma)
        out.append(n)
        i += n + 1
    return out


@torch.inference_mode()
def teacher_forced_logits(model, tokens: list[int], start: int) -> torch.Tensor:
    """Logits predicting tokens[start:] ``[len - start, V]`` from one prefill."""
    model.setup_cache(len(tokens), 1)
    return model(torch.tensor([tokens]), 0)[0, start - 1: len(tokens) - 1]


def score_sequence(target, draft, *, tokens: list[int], n_prompt: int, temperature: float,
                   gamma: int) -> dict:
    """β per continuation position and (T0) the accepted lengths of sync rounds; ``draft`` is a
    model, or an eagle head (real/model/eagle.py: one step from the target's features for β, its
    own chained features for the accepted lengths)."""
    eagle = isinstance(draft, EagleHead)
    p_logits = teacher_forced_logits(target, tokens, n_prompt)
    q_logits = forced_logits(draft, target, tokens, n_prompt) if eagle else \
        teacher_forced_logits(draft, tokens, n_prompt)
    params = T0 if temperature == 0 else SamplingParams(temperature=temperature)
    beta = expected_acceptance(standardize(p_logits, params), standardize(q_logits, params))
    out = {"positions": len(beta), "beta_sum": float(beta.sum())}
    if temperature == 0:
        out["accepted"] = chain_accepted(draft, target, tokens, n_prompt=n_prompt, gamma=gamma) if eagle else \
            sync_accepted_lengths(p_logits.argmax(-1), q_logits.argmax(-1), gamma)
    return out


@torch.inference_mode()
def decode_forward_ms(target, draft, *, context: int, reps: int, seed: int) -> tuple[float, float]:
    """Median ms of one batch-1, one-token forward after ``context`` tokens, per model (an
    eagle head: its layer, fc and the target's LM head)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, target.args.vocab_size, (1, context), generator=gen)
    steps = [target]
    if isinstance(draft, EagleHead):
        head = EagleDraft(draft, target, T0, "eagle")
        target.keep_hidden = False
        steps.append(lambda x, pos: head.forward_probs(x[0].tolist(), pos))
        target.setup_cache(context + 1, 1)
        target(ctx, 0)
        head.forward_probs(ctx[0].tolist(), 1)
    else:
        steps.append(draft)
        for m in (target, draft):
            m.setup_cache(context + 1, 1)
            m(ctx, 0)
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(reps + 3):
        x = torch.randint(0, target.args.vocab_size, (1, 1), generator=gen)
        for j, m in enumerate(steps):
            t = time.perf_counter()
            m(x, context)  # same slot every time: constant context length
            if r >= 3:  # warm-up
                times[j].append(time.perf_counter() - t)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def evaluate(cfg: DictConfig) -> dict:
    from real.model.weights import load_model
    from testbed.workloads import load_prompts, render, select, split_prompts

    torch.set_num_threads(int(cfg.threads))
    max_seq = cfg.max_prompt_tokens + cfg.max_new_tokens + 8
    target, tok = load_model(max_seq=max(max_seq, cfg.timing.context + 1))
    if is_eagle_dir(repo_path(cfg.draft)):
        draft = load_head(repo_path(cfg.draft), target)
    else:
        draft, _ = load_model(repo_path(cfg.draft), max_seq=max(max_seq, cfg.timing.context + 1))
    if not isinstance(draft, EagleHead) and draft.args.vocab_size != target.args.vocab_size:
        raise SystemExit(f"draft vocab {draft.args.vocab_size} != target vocab {target.args.vocab_size}")
    results: dict = {"draft": str(cfg.draft), "gamma": cfg.gamma, "workloads": {}}
    for name in cfg.workloads:
        prompts = select(split_prompts(load_prompts(name), cfg.prompt_split), cfg.num_prompts, cfg.seed)
        ids = []
        for p in prompts:
            text = render(p, tok)
            ids.append((tok.encode(text) if isinstance(text, str) else list(text))[-cfg.max_prompt_tokens:])
        row: dict = {"prompts": len(prompts), "split": cfg.prompt_split}
        for temp in (0.0, 1.0):
            gen = torch.Generator().manual_seed(cfg.seed)
            seqs = []
            for j in range(0, len(ids), cfg.gen_batch):
                seqs += generate_batch(target, ids[j: j + cfg.gen_batch], max_new=cfg.max_new_tokens,
                                       temperature=temp, k=1, eos=tok.eos_token_ids, gen=gen)
            scores = [score_sequence(target, draft, tokens=s["tokens"].tolist(), n_prompt=s["n_prompt"], temperature=temp,
                                     gamma=cfg.gamma) for s in seqs if len(s["tokens"]) > s["n_prompt"]]
            pos = sum(s["positions"] for s in scores)
            alpha = sum(s["beta_sum"] for s in scores) / max(1, pos)
            key = "T0" if temp == 0 else "T1"
            row[f"alpha_{key}"] = alpha
            row[f"positions_{key}"] = pos
            if temp == 0:
                acc = [n for s in scores for n in s["accepted"]]
                row["mean_accepted_T0"] = sum(acc) / max(1, len(acc))
                row["tokens_per_round_T0"] = row["mean_accepted_T0"] + 1
                row["rounds_T0"] = len(acc)
            print(f"{name} {key}: alpha={alpha:.3f} over {pos} positions", flush=True)
        results["workloads"][name] = row
    t_ms, d_ms = decode_forward_ms(target, draft, context=cfg.timing.context, reps=cfg.timing.reps, seed=cfg.seed)
    results["timing"] = {"context": cfg.timing.context, "reps": cfg.timing.reps,
                         "threads": int(cfg.threads), "target_ms": t_ms, "draft_ms": d_ms,
                         "c": d_ms / t_ms}
    results["config"] = OmegaConf.to_container(cfg, resolve=True)
    return results


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    g = results["gamma"]
    table = Table(title=f"draft {results['draft']} vs SmolLM2-135M-Instruct (holdout)")
    for col in ("workload", "prompts", "α T0", "α T1", f"accepted/round γ={g} T0",
                "tokens/round T0"):
        table.add_column(col, justify="right")
    for name, r in results["workloads"].items():
        table.add_row(name, str(r["prompts"]), f"{r['alpha_T0']:.3f}", f"{r['alpha_T1']:.3f}",
                      f"{r['mean_accepted_T0']:.2f}", f"{r['tokens_per_round_T0']:.2f}")
    console = Console()
    console.print(table)
    t = results["timing"]
    console.print(f"decode forward (batch 1, context {t['context']}, {t['threads']} thread(s)): "
                  f"target {t['target_ms']:.2f} ms, draft {t['draft_ms']:.2f} ms, c = {t['c']:.3f}")


def run(cfg: DictConfig) -> Path:
    results = evaluate(cfg)
    out = repo_path(cfg.out_dir) / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"wrote {out / 'eval.json'}")
    return out


def main() -> None:
    import hydra

    @hydra.main(config_path=str(ROOT / "conf"), config_name="eval_draft", version_base=None)
    def _run(cfg: DictConfig) -> None:
        run(cfg)

    _run()


if __name__ == "__main__":
    main()
