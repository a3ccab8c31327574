"""Which of the target's features an eagle head should read: the last layer's (EAGLE-1/2, the
shipped head) or several layers' fused (EAGLE-3: low, middle and last), at equal data and steps.

    taskset -c 0,1 python benchmarks/bench_eagle_features.py [--shards 30] [--steps 300]
        [--variants last fused] [--layers 3 15 30]

Both heads are ``real.model.eagle.EagleHead``s trained by ``real.train.eagle``'s recipe (smooth-L1
on the next last-layer feature + cross-entropy against the target's distribution on 25 % of the
positions, input noise 0.2 × RMS per layer, AdamW lr 1e-3, cosine, 8 rows x 256 positions a
step, seed 0) on the first ``--shards`` teacher batches of ``real.train.draft_data`` (built into
``.cache/train_draft/data`` if missing; the first 30 are the target's greedy continuations of the
``calibrate`` prompts). The fused head's fc reads ``[embed(x_j), norm(h3_{j-1}), norm(h15_{j-1}),
norm(f_{j-1})]`` (h_l: the residual stream after l layers; f: after all 30), the last-layer
head's ``[embed(x_j), norm(f_{j-1})]``. Scored every 100 steps on the HumanEval ``holdout``
prompts' greedy continuations (30 prompts, <= 128 tokens): the share of continuation positions
where the head's argmax one step from the target's true features (the first guess of a round)
equals the target's, over the whole vocabulary. The features are cached beside the shards.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import specbed_kernels as kernels  # noqa: E402
from real.model.eagle import EagleHead  # noqa: E402
from real.model.weights import load_model  # noqa: E402
from real.train.draft_data import build_teacher_data, generate_batch, map_in_threads  # noqa: E402
from real.train.eagle import _rms, lr_at  # noqa: E402
from testbed.paths import repo_path  # noqa: E402


class LayersHead(EagleHead):
    """An eagle head whose fc reads ``n_features`` feature vectors (each with its own norm)."""

    def __init__(self, args, n_features: int) -> None:  # noqa: ANN001 - real.model.decoder.ModelArgs
        super().__init__(args)
        dim = args.dim
        self.n_features = n_features
        self.fc_weight = nn.Parameter(torch.empty(dim, (1 + n_features) * dim), requires_grad=False)
        self.feature_norm = nn.Parameter(torch.ones(n_features * dim), requires_grad=False)

    def inputs(self, target, tokens: Tensor, features: Tensor) -> Tensor:  # noqa: ANN001
        e, d = target.embed(tokens), target.args.dim
        normed = [kernels.rms_norm(features[..., i * d:(i + 1) * d].to(e.dtype),
                                   self.feature_norm[i * d:(i + 1) * d], self.args.norm_eps)
                  for i in range(self.n_features)]
        return kernels.linear(torch.cat([e, *normed], dim=-1), self.fc_weight) + self.fc_bias


def layer_features(target, ids: list[int], layers: list[int]) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """(tokens int32 [L], the residual stream after each of ``layers`` layers, fp16 [L, n x dim])."""
    with torch.inference_mode():
        h, lo, outs = target.embed(torch.tensor([ids])), 0, []
        for hi in layers:
            h = target.forward_layers(h, cache=False, lo=lo, hi=hi)
            outs.append(h[0].to(torch.float16))
            lo = hi
    return torch.tensor(ids, dtype=torch.int32), torch.cat(outs, -1)


def held_out(target, tok, layers: list[int]) -> list[tuple]:  # noqa: ANN001
    from testbed.workloads import load_prompts, render, select, split_prompts

    prompts = select(split_prompts(load_prompts("humaneval"), "holdout"), 30, 0)
    ids = []
    for p in prompts:
        text = render(p, tok)
        ids.append((tok.encode(text) if isinstance(text, str) else list(text))[-384:])
    seqs = generate_batch(target, ids, max_new=128, temperature=0.0, k=1, eos=tok.eos_token_ids,
                          gen=torch.Generator().manual_seed(0))
    out = []
    for s in seqs:
        tokens, n = s["tokens"].tolist(), s["n_prompt"]
        if len(tokens) > n + 1:
            tk, fe = layer_features(target, tokens, layers)
            with torch.inference_mode():
                argmax = target.head(fe[:, -target.args.dim:].float()).argmax(-1)
            out.append((tk, fe, argmax, n))
    return out


def top1(head: LayersHead, target, hold: list[tuple], cols: Tensor) -> float:  # noqa: ANN001
    hits = total = 0
    with torch.inference_mode(), kernels.reference_kernels():
        for tk, fe, argmax, n in hold:
            pred = head(target, tk[1:].long()[None], fe[None, :-1, cols].float(), cache=False)[0]
            guess = target.head(pred).argmax(-1)  # guess[j - 1] and argmax[j] predict token j + 1
            js = torch.arange(max(1, n - 1), len(tk) - 1)
            hits += int((guess[js - 1] == argmax[js]).sum())
            total += len(js)
    return hits / total


def train(head: LayersHead, target, rows: tuple[Tensor, Tensor], cols: Tensor, *, steps: int,  # noqa: ANN001
          report) -> None:  # noqa: ANN001
    dim = target.args.dim
    params = [head.fc_weight, head.fc_bias, head.feature_norm, *head.body.layers.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    tokens, feats = rows
    for step in range(steps):
        pick = torch.randint(0, tokens.shape[0], (8,), generator=gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps=steps, lr=1e-3, warmup=30)
        tk, fe = tokens[pick], feats[pick]
        f_in = fe[:, :-1, cols].float()
        shape = f_in.shape
        per = f_in.view(*shape[:-1], -1, dim)
        f_in = (per + 0.2 * per.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn(per.shape, generator=gen)).view(shape)
        with kernels.reference_kernels():
            pred = head(target, tk[:, 1:], f_in, cache=False)
            true = fe[:, 1:, -dim:].float()
            reg = F.smooth_l1_loss(_rms(pred), _rms(true))
            keep = torch.rand(pred.shape[:2], generator=gen) < 0.25
            with torch.no_grad():
                p = torch.softmax(target.head(true[keep]), -1)
            loss = reg - (p * torch.log_softmax(target.head(pred[keep]), -1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            for p in params:
                p.requires_grad_(False)
            report(step + 1, float(loss.detach()))
            for p in params:
                p.requires_grad_(True)
    for p in params:
        p.requires_grad_(False)


def main() -> None:
    from hydra import compose, initialize_config_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=30)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 15, 30], help="the fused head's layers (last: all)")
    ap.add_argument("--variants", nargs="+", default=["last", "fused"], choices=["last", "fused"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    with initialize_config_dir(config_dir=str(repo_path("conf")), version_base=None):
        cfg = compose(config_name="train_draft", overrides=["threads=2"])
    data = repo_path(cfg.work_dir) / "data"
    shards = build_teacher_data(cfg, data, limit=args.shards, workers=2)
    target, tok = load_model(max_seq=520)
    layers, dim = args.layers, target.args.dim
    if layers[-1] != target.args.n_layers:
        raise SystemExit(f"--layers must end with {target.args.n_layers} (the head predicts the last layer's feature)")
    cache = data.parent / f"features_{'_'.join(map(str, layers))}_{args.shards}.pt"
    if cache.is_file():
        docs, hold = torch.load(cache)
    else:
        seqs = [d["tokens"].tolist()[:512] for p in sorted(shards) for d in torch.load(p, weights_only=False)]
        seqs = [s for s in seqs if len(s) >= 3]
        layer_features(target, seqs[0], layers)  # packs the weights before the threads share them
        docs = map_in_threads(lambda s: layer_features(target, s, layers), seqs, 2)
        hold = held_out(target, tok, layers)
        torch.save((docs, hold), cache)
    order = list(range(len(docs)))
    random.Random(0).shuffle(order)
    toks = torch.cat([docs[i][0] for i in order]).long()
    feats = torch.cat([docs[i][1] for i in order])
    n = len(toks) // 256 * 256
    rows = toks[:n].view(-1, 256), feats[:n].view(-1, 256, feats.shape[-1])
    print(f"{len(docs)} documents, {n} positions; held out: {len(hold)} continuations", flush=True)
    for variant in args.variants:
        cols = torch.arange(len(layers) * dim) if variant == "fused" else torch.arange((len(layers) - 1) * dim, len(layers) * dim)
        head = LayersHead(target.args, len(cols) // dim).init_random(0, 0.02)
        head.fc_weight.data.copy_(torch.randn(head.fc_weight.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
        start = time.time()

        def report(step: int, loss: float, head=head, cols=cols, variant=variant, start=start) -> None:  # noqa: ANN001
            print(f"{variant:5s} step {step:4d}  loss {loss:.3f}  held-out top-1 {top1(head, target, hold, cols):.3f}"
                  f"  ({time.time() - start:.0f} s)", flush=True)

        train(head, target, rows, cols, steps=args.steps, report=report)


if __name__ == "__main__":
    main()
