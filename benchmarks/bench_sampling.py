"""Cost of turning logits into a standardized distribution (testbed.spec.sampling.standardize).

Every draft token and every verified position pays it once, so on the 49k-token vocabulary of
the bundled pair it must stay a small share of one draft forward (~2-3 ms on one core).
Logits are the real next-token logits of the bundled target and of the trained draft over a
HumanEval prompt (``--logits model``), or heavy-tailed random ones (``--logits random``: a flat
nucleus of thousands of tokens, the worst case). Every figure is the best of ``--repeats``
(the machine is shared: the minimum is what the code costs), per distribution, for the fast
path (``standardize``) and the full sort it replaced (``full_sort``, kept here as the "before");
then the draw of one token from each standardized distribution (``sample``: the CDF inverted at
one uniform) beside ``torch.multinomial`` (the draw it replaced); with ``--verify`` also a
verification's share: standardizing the γ + 1 rows of the target's logits at once plus one draw
(Algorithm 1's residual or bonus token), against that (γ + 1)-token forward of the bundled target
in the dtype real runs use (``real.dtype=auto``), after 200 cached tokens.

    taskset -c 1 python benchmarks/bench_sampling.py --logits model
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from testbed.spec.sampling import SamplingParams, sample, standardize

MODES = {
    "greedy": SamplingParams(0.0),
    "T=0.7": SamplingParams(0.7),
    "T=0.7 top_k=50": SamplingParams(0.7, top_k=50),
    "T=0.7 top_p=0.9": SamplingParams(0.7, top_p=0.9),
    "T=1 top_p=0.95": SamplingParams(1.0, top_p=0.95),
    "T=1 top_k=50 top_p=0.9": SamplingParams(1.0, top_k=50, top_p=0.9),
}


def full_sort(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The implementation before the fast path: top-p by sorting the whole vocabulary."""
    if params.greedy or params.top_p >= 1.0:
        return standardize(logits, params)
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    sorted_p = torch.softmax(sorted_x, dim=-1)
    drop_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p >= params.top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.softmax(x.masked_fill(drop, float("-inf")), dim=-1)


def best_ms(fn: Callable[[torch.Tensor, SamplingParams], torch.Tensor], rows: torch.Tensor,
            params: SamplingParams, repeats: int) -> float:
    """Best-of-``repeats`` ms per distribution, one row at a time (as a draft calls it)."""
    best = float("inf")
    for _ in range(repeats):
        s = time.perf_counter()
        for row in rows:
            fn(row, params)
        best = min(best, (time.perf_counter() - s) / len(rows))
    return best * 1e3


def model_logits(n: int) -> dict[str, torch.Tensor]:
    from real.model.weights import load_model
    with open("data/humaneval.jsonl") as f:
        prompt = json.loads(f.readline())["prompt"]
    out = {}
    for name, path in (("target", None), ("draft", "models/smollm2-draft")):
        model, tok = load_model(path, max_seq=512)
        ids = tok.encode(prompt)[: 256]
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), input_pos=0)[0]
        out[name] = logits[-n:].clone()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logits", choices=["model", "random"], default="model")
    ap.add_argument("--rows", type=int, default=16, help="distributions per measurement")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--verify", type=int, nargs="*", default=None, metavar="K",
                    help="also a K-row verification's sampling against its forward (default K: 2 5 9)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.logits == "model":
        sets = model_logits(args.rows)
    else:
        gen = torch.Generator().manual_seed(0)
        sets = {"random": torch.randn(args.rows, 49152, generator=gen) * 3.0}
    print(f"threads 1, load average {os.getloadavg()[0]:.2f}, best of {args.repeats}, "
          f"ms per distribution ({args.logits} logits, vocabulary {next(iter(sets.values())).shape[-1]})")
    print(f"{'mode':<24}" + "".join(f"{f'{k} before':>16}{f'{k} after':>16}" for k in sets))
    for name, params in MODES.items():
        cells = ""
        for rows in sets.values():
            cells += f"{best_ms(full_sort, rows, params, args.repeats):>16.3f}"
            cells += f"{best_ms(standardize, rows, params, args.repeats):>16.3f}"
        print(f"{name:<24}{cells}")
    gen = torch.Generator().manual_seed(0)
    draws = {"torch.multinomial": lambda p, _: torch.multinomial(p, 1, generator=gen),
             "sample": lambda p, _: sample(p, gen)}
    print("one draw from a standardized distribution (T=0.7), ms")
    print(f"{'draw':<24}" + "".join(f"{k:>16}" for k in sets))
    for name, fn in draws.items():
        cells = "".join(f"{best_ms(fn, standardize(rows, MODES['T=0.7']), MODES['T=0.7'], args.repeats):>16.3f}"
                        for rows in sets.values())
        print(f"{name:<24}{cells}")
    if args.verify is not None:
        verify_share(args.verify or [2, 5, 9], args.repeats)


def verify_share(ks: list[int], repeats: int) -> None:
    """Per K and sampling mode: ms of standardize over K rows + one draw, and its % of the
    K-token forward that produced them (both best of ``repeats``)."""
    from real.model.weights import load_model
    from specbed_kernels import preferred_dtype

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[preferred_dtype("cpu")]
    model, tok = load_model(None, dtype=dtype, max_seq=512)
    with open("data/humaneval.jsonl") as f:  # a prompt of > 200 tokens: its text continues the context
        ids = next(i for i in (tok.encode(json.loads(line)["prompt"]) for line in f) if len(i) > 200 + max(ks))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.tensor([ids[:200]]), input_pos=0)
        print(f"a verification's sampling against its forward ({preferred_dtype('cpu')}, 200 cached tokens)")
        print(f"{'mode':<24}" + "".join(f"{f'K={k} ms':>12}{f'K={k} %':>10}" for k in ks))
        forwards, logits = {}, {}
        for k in ks:
            x = torch.tensor([ids[200:200 + k]])
            best = float("inf")
            for _ in range(repeats):
                s = time.perf_counter()
                out = model(x, input_pos=200)  # the same slots each time
                best = min(best, time.perf_counter() - s)
            forwards[k], logits[k] = best, out[0].float()
        for name, params in MODES.items():
            if params.greedy:
                continue
            cells = ""
            for k in ks:
                best = float("inf")
                for _ in range(repeats):
                    s = time.perf_counter()
                    sample(standardize(logits[k], params)[-1], gen)
                    best = min(best, time.perf_counter() - s)
                cells += f"{best * 1e3:>12.3f}{100 * best / forwards[k]:>9.1f}%"
            print(f"{name:<24}{cells}")
        print(f"{'forward ms':<24}" + "".join(f"{forwards[k] * 1e3:>12.2f}{'':>10}" for k in ks))


if __name__ == "__main__":
    main()
