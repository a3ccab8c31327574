"""A draft vocabulary for an eagle head: the tokens it may propose (real/model/eagle.py).

    python -m real.train.draft_vocab --head models/smollm2-eagle --size 8192 --prompts 48

The head's step is one decoder layer plus the target's LM head, and the LM head (49,152 x 576
for SmolLM2) is most of its cost. Restricting the proposals to the tokens the target actually
emits computes only those rows (EAGLE-3 and FR-Spec do the same): a token outside is never
proposed, which costs acceptance only where the target emits it. The ranking: first every
token of the target's own greedy continuations of the ``calibrate`` prompts (the draft's job
is to guess these), by count; then the rest by their count in the prompts and in Python
standard-library text (the tail: identifiers and prose the continuations did not reach). The
``holdout`` prompts are never read. Writes ``draft_vocab.safetensors`` into the head's folder
and records the size and the sources in its ``config.json``; ``--size 0`` removes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

import torch

from real.model.eagle import CONFIG_FILE, VOCAB_FILE, is_eagle_dir, save_draft_vocab
from real.train.draft_data import calibration_prompts, generate_batch, stdlib_text
from testbed.paths import repo_path


def rank_tokens(generated: Counter, corpus: Counter, vocab_size: int) -> list[int]:
    """Every token id, most wanted first: by count in the target's continuations, then by count
    in the corpus, then by id."""
    return sorted(range(vocab_size), key=lambda t: (-generated.get(t, 0), -corpus.get(t, 0), t))


def target_counts(target, tok, *, prompts: int, tokens: int, batch: int) -> tuple[Counter, Counter, int]:  # type: ignore[no-untyped-def]
    """(counts of the target's greedy continuation tokens, counts of the prompts' tokens, the
    number of prompts) over the ``calibrate`` split of every workload."""
    ids = [p[-384:] for _, p in calibration_prompts(tok, prompts)]
    generated, corpus = Counter(), Counter()
    gen = torch.Generator().manual_seed(0)
    for j in range(0, len(ids), batch):
        for s in generate_batch(target, ids[j: j + batch], max_new=tokens, temperature=0.0, k=1,
                                eos=tok.eos_token_ids, gen=gen):
            generated.update(s["tokens"][s["n_prompt"]:].tolist())
        print(f"draft_vocab: {min(j + batch, len(ids))}/{len(ids)} prompts continued", flush=True)
    for p in ids:
        corpus.update(p)
    return generated, corpus, len(ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", default="models/smollm2-eagle", help="the eagle head's folder")
    p.add_argument("--size", type=int, default=8192, help="tokens kept (0: remove the draft vocabulary)")
    p.add_argument("--prompts", type=int, default=48, help="calibrate prompts per workload")
    p.add_argument("--tokens", type=int, default=128, help="continuation tokens per prompt")
    p.add_argument("--stdlib-chars", type=int, default=2_000_000)
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args(argv)
    head_dir = repo_path(a.head)
    if not is_eagle_dir(head_dir):
        print(f"draft_vocab: {a.head} is not an eagle head's folder (config.json with architecture specbed-eagle)")
        return 2
    config = json.loads((head_dir / CONFIG_FILE).read_text())
    if a.size == 0:
        (head_dir / VOCAB_FILE).unlink(missing_ok=True)
        config.pop("draft_vocab", None)
        (head_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
        return 0
    from real.model.weights import load_model

    torch.set_num_threads(1)
    started = time.perf_counter()
    target, tok = load_model(max_seq=384 + a.tokens + 8)
    if not 0 < a.size <= target.args.vocab_size:
        print(f"draft_vocab: --size {a.size} must be in 1..{target.args.vocab_size}")
        return 2
    generated, corpus, n_prompts = target_counts(target, tok, prompts=a.prompts, tokens=a.tokens, batch=a.batch)
    corpus.update(tok.encode(stdlib_text(a.stdlib_chars, seed=0)))
    ranked = rank_tokens(generated, corpus, target.args.vocab_size)[: a.size]
    save_draft_vocab(torch.tensor(ranked), head_dir)  # distinct ids of the vocabulary by construction
    total = sum(generated.values())
    kept = set(ranked)
    config["draft_vocab"] = {
        "size": a.size, "of": target.args.vocab_size,
        "generated_tokens": total, "generated_distinct": len(generated),
        "generated_covered": round(sum(c for t, c in generated.items() if t in kept) / max(1, total), 5),
        "sources": f"greedy continuations ({a.tokens} tokens) of {n_prompts} calibrate prompts "
                   f"(<= {a.prompts} per workload), then the prompts and {a.stdlib_chars} chars of stdlib text",
        "command": "python -m real.train.draft_vocab " + " ".join(sys.argv[1:] if argv is None else argv)}
    (head_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    print(f"draft_vocab: {a.size} of {target.args.vocab_size} tokens -> {head_dir / VOCAB_FILE} "
          f"(the continuations: {len(generated)} distinct tokens of {total}; "
          f"{time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
