"""Train an eagle head (real/model/eagle.py) for the bundled target: ``python -m real.train.draft kind=eagle``.

Data (self-distillation, never the held-out splits): the documents of real/draft_data.py's
teacher data -- the target's own greedy and sampled continuations of the ``calibrate`` split
prompts and of stdlib function headers, plus teacher-forced stdlib source -- shared with the
small draft's training (``.cache/train_draft/data``). For each document the target's
features (its last layer's output, pre-norm) are computed once, teacher-forced, and cached.

Loss, as in EAGLE: the head sees (f_{j-1} + noise, x_j) and predicts f̂_j;
``feature_weight`` × smooth-L1 between the normalised f̂_j and f_j (the LM head's input) plus
the cross-entropy of softmax(head(f̂_j)) against the target's own distribution softmax(head(f_j))
over the whole vocabulary. The noise (relative to the features' RMS) makes the head robust
to reading its own predictions when it drafts more than one token.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

import specbed_kernels as kernels
from real.errors import RealSetupError
from real.model.decoder import Transformer
from real.model.eagle import EagleHead, is_eagle_dir, load_head, save_head
from real.model.weights import load_model
from real.train.draft_data import _atomic_save, build_teacher_data, map_in_threads
from testbed.paths import repo_path


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def target_features(target: Transformer, docs: list[list[int]], max_len: int,
                    threads: int = 1) -> list[tuple[Tensor, Tensor]]:
    """(tokens int32 [L], features fp16 [L, dim]) per document (cut to ``max_len``), teacher-forced.
    ``threads`` > 1: documents in that many threads at once (the native kernels run without the
    GIL; each document's forward is the one it gets alone, so the features do not change)."""
    @torch.inference_mode()
    def one(ids: list[int]) -> tuple[Tensor, Tensor] | None:
        ids = ids[:max_len]
        if len(ids) < 3:
            return None
        h = target.forward_layers(target.embed(torch.tensor([ids])), cache=False)[0]
        return torch.tensor(ids, dtype=torch.int32), h.to(torch.float16)

    if threads <= 1 or len(docs) < 2:
        results = [one(ids) for ids in docs]
    else:
        results, i = [], 0
        while i < len(docs) and (not results or results[-1] is None):
            results.append(one(docs[i]))  # the first forward packs the weights the threads share
            i += 1
        results += map_in_threads(one, docs[i:], threads)
    return [r for r in results if r is not None]


def pack_rows(docs: list[tuple[Tensor, Tensor]], seq_len: int, seed: int) -> tuple[Tensor, Tensor]:
    """Documents shuffled by ``seed`` and concatenated, cut into rows ``[R, seq_len]`` (tokens)
    and ``[R, seq_len, dim]`` (features); a row may span two documents, as in the small draft's."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    toks = torch.cat([docs[i][0] for i in order]).long()
    feats = torch.cat([docs[i][1] for i in order])
    n = len(toks) // seq_len * seq_len
    return toks[:n].view(-1, seq_len), feats[:n].view(-1, seq_len, feats.shape[-1])


def unroll_mask(steps: int, n: int) -> Tensor:
    """Attention ``[steps·n, steps·n]`` of a row unrolled ``steps`` times (training-time test, as
    EAGLE-3 trains): step i's row at pair p, whose input is the head's own step-(i-1) prediction,
    sees what the head's cache holds when it drafts its (i+1)-th guess there -- the pairs <= p-i,
    fed with the target's true features, and its own chain's rows (j, p-i+j) for j = 1..i.
    Step 0 is the plain causal row."""
    i = torch.arange(steps)[:, None, None, None]
    p = torch.arange(n)[None, :, None, None]
    j = torch.arange(steps)[None, None, :, None]
    q = torch.arange(n)[None, None, None, :]
    mask = ((j == 0) & (q <= p - i)) | ((j >= 1) & (j <= i) & (q == p - i + j))
    return mask.reshape(steps * n, steps * n)


def unrolled_predictions(head: EagleHead, target: Transformer, tokens: Tensor, features: Tensor,
                         steps: int) -> Iterator[Tensor]:
    """The head's predicted features ``[B, T, dim]`` for pairs (``tokens``, ``features``), then
    ``steps`` - 1 more times with each pair's feature replaced by the head's own prediction of
    it from the step before (detached; pair 0 keeps its given feature): step i at pair p is the
    head's (i+1)-th guess of a chain that read the true features up to pair p-i."""
    n = tokens.shape[1]
    inputs = [head.inputs(target, tokens, features)]
    for step in range(steps):
        if step == 0:
            pred = head.body.forward_layers(inputs[0], cache=False)
        else:
            pred = head.body.forward_layers(torch.cat(inputs, dim=1), mask=unroll_mask(step + 1, n),
                                            position_ids=torch.arange(n).repeat(step + 1),
                                            cache=False)[:, step * n:]
        yield pred
        if step + 1 < steps:
            own = torch.cat([features[:, :1], pred[:, :-1].detach()], dim=1)
            inputs.append(head.inputs(target, tokens, own))


def eagle_loss(head: EagleHead, target: Transformer, tokens: Tensor, feats: Tensor, *,
               noise: float, feature_weight: float, ce_share: float = 1.0, unroll: int = 1,
               gen: torch.Generator | None = None) -> tuple[Tensor, float]:
    """(loss, top-1 agreement of the first step) of one batch: rows of tokens ``[B, L]`` and
    features ``[B, L, dim]``. The cross-entropy runs over a random ``ce_share`` of the positions
    (the LM head over the vocabulary, twice, is most of a step's cost; the feature regression
    covers every position). ``unroll`` > 1 also trains the head's later guesses: step i reads the
    head's own predictions of step i-1 (detached) as a chain draft does, with ``unroll_mask``,
    and the steps' losses are averaged."""
    toks, true = tokens[:, 1:], feats[:, 1:].float()
    f_in = feats[:, :-1].float()
    if noise > 0:
        scale = f_in.pow(2).mean(-1, keepdim=True).sqrt()
        f_in = f_in + noise * scale * torch.randn(f_in.shape, generator=gen)
    b, n = toks.shape
    pick = None
    if ce_share < 1.0:
        pick = torch.rand((b, n), generator=gen) < ce_share
        pick[0, 0] = True
    with torch.no_grad():
        p = torch.softmax(target.head(true if pick is None else true[pick]), dim=-1)
    total: Tensor | float = 0.0
    agree = 0.0
    for step, pred in enumerate(unrolled_predictions(head, target, toks, f_in, unroll)):
        reg = F.smooth_l1_loss(_rms(pred), _rms(true))
        logq = torch.log_softmax(target.head(pred if pick is None else pred[pick]), dim=-1)
        total = total + feature_weight * reg - (p * logq).sum(-1).mean()
        if step == 0:
            agree = float((logq.argmax(-1) == p.argmax(-1)).float().mean())
    assert isinstance(total, Tensor)
    return total / unroll, agree


def trainable(head: EagleHead) -> list[torch.nn.Parameter]:
    """fc, feature norm and the decoder layer (the body's placeholder embedding/norm/head are unused)."""
    params = [head.fc_weight, head.fc_bias, head.feature_norm, *head.body.layers.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def lr_at(step: int, *, steps: int, lr: float, warmup: int, min_frac: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train_head(head: EagleHead, target: Transformer, rows: tuple[Tensor, Tensor], *, steps: int,
               batch_rows: int, lr: float, seed: int, noise: float = 0.2, feature_weight: float = 1.0,
               ce_share: float = 1.0, unroll: int = 1, unroll_from: int = 0, warmup: int = 20,
               progress: bool = False) -> dict:
    """AdamW (warm-up, cosine decay) over ``steps`` batches of ``batch_rows`` rows drawn by a
    generator seeded with ``seed``; the head is trained in place. Returns the last losses."""
    from tqdm import tqdm

    params = trainable(head)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() == 2], "weight_decay": 0.0},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    tokens, feats = rows
    ema_loss = ema_agree = None
    bar = tqdm(range(steps), desc="eagle", unit="step", disable=not progress, mininterval=5, dynamic_ncols=True)
    with kernels.reference_kernels():
        for step in bar:
            pick = torch.randint(0, tokens.shape[0], (batch_rows,), generator=gen)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps=steps, lr=lr, warmup=warmup)
            loss, agree = eagle_loss(head, target, tokens[pick], feats[pick], noise=noise,
                                     feature_weight=feature_weight, ce_share=ce_share,
                                     unroll=unroll if step >= unroll_from else 1,
                                     gen=gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            val = float(loss.detach())
            ema_loss = val if ema_loss is None else 0.95 * ema_loss + 0.05 * val
            ema_agree = agree if ema_agree is None else 0.95 * ema_agree + 0.05 * agree
            bar.set_postfix(loss=f"{ema_loss:.3f}", top1=f"{ema_agree:.3f}")
    for p in params:
        p.requires_grad_(False)
    return {"loss": ema_loss, "top1_agreement": ema_agree}


def train(cfg: DictConfig) -> EagleHead:
    """The bundled target's head: teacher documents -> features (cached) -> training -> ``cfg.eagle.out``."""
    e = cfg.eagle
    if int(e.unroll) < 1 or int(e.unroll_from) < 0:
        raise RealSetupError(f"eagle.unroll={e.unroll} eagle.unroll_from={e.unroll_from}: unroll is 1 (no "
                             "training-time test) or more steps, unroll_from a step >= 0")
    if e.get("init") and not is_eagle_dir(repo_path(e.init)):
        raise RealSetupError(f"eagle.init={e.init}: not an eagle head directory (config.json + "
                             "model.safetensors); give a trained head, or null for a fresh one")
    torch.set_num_threads(int(cfg.threads))
    t0 = time.time()
    work = repo_path(cfg.work_dir)
    data_dir = repo_path(cfg.data_dir) if cfg.get("data_dir") else work / "data"
    paths = build_teacher_data(cfg, data_dir, limit=e.get("shards"), workers=int(cfg.threads))
    target, _ = load_model(max_seq=e.max_len + 8)
    feats_path = work / f"eagle_features_{e.max_len}_{len(paths)}.pt"
    if feats_path.is_file():
        docs = torch.load(feats_path, weights_only=False)
    else:
        seqs = [d["tokens"].tolist() for p in sorted(paths) for d in torch.load(p, weights_only=False)]
        docs = target_features(target, seqs, e.max_len, threads=int(cfg.threads))
        _atomic_save(docs, feats_path)
    t_data = time.time() - t0
    rows = pack_rows(docs, e.seq_len, cfg.seed)
    if e.get("init"):  # continue training a head (e.g. the shipped one, on more steps or another loss)
        head = load_head(repo_path(e.init), target)
    else:
        head = EagleHead(target.args).init_random(cfg.seed, std=0.02)
    t1 = time.time()
    last = train_head(head, target, rows, steps=e.steps, batch_rows=e.batch_rows, lr=e.lr, seed=cfg.seed,
                      noise=e.noise, feature_weight=e.feature_weight, ce_share=e.ce_share,
                      unroll=e.unroll, unroll_from=e.unroll_from, warmup=e.warmup, progress=True)
    train_s = time.time() - t1
    info = {"steps": e.steps, "unroll": e.unroll, "unroll_from": e.unroll_from, "init": e.get("init"),
            "train_s": round(train_s, 1), "data_s": round(t_data, 1),
            "positions": int(rows[0].numel()), "documents": len(docs), **last,
            "config": OmegaConf.to_container(cfg, resolve=True)}
    out = repo_path(e.out)
    save_head(head, out, target_name="smollm2_135m", extra={"training": {k: info[k] for k in (
        "steps", "unroll", "unroll_from", "init", "train_s", "positions", "documents", "loss", "top1_agreement")}})
    (work / "eagle_train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"exported {out} after {e.steps} steps ({train_s:.0f} s training, {t_data:.0f} s data)")
    return head
