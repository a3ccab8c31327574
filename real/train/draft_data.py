"""Teacher data for the draft's distillation (real/train/draft.py, phase 1): the target's greedy
and sampled continuations of calibration prompts and of function headers cut from the Python
standard library, plus teacher-forced chunks of stdlib source, each position with the target's
top-k log-probabilities; cached one file per batch under ``work_dir/data`` and reused. Then
packed into one tensor set whose batch order is a pure function of (seed, step).
"""

from __future__ import annotations

import ast
import json
import os
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import Tensor


# ------------------------------------------------------------------------- teacher data
def _atomic_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def map_in_threads(fn, items: list, threads: int) -> list:
    """``[fn(x) for x in items]`` in ``threads`` threads at once, torch's intra-op pool set to one
    thread meanwhile (one core per item, not threads x intra-op threads; the native kernels run
    without the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    intra = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(fn, items))
    finally:
        torch.set_num_threads(intra)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def stdlib_function_prompts(n: int, seed: int) -> list[str]:
    """HumanEval-like completion prompts: a stdlib function's ``def`` line and docstring."""
    out: list[str] = []
    if n <= 0:
        return out
    for path in stdlib_files():
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or len(node.body) < 3:
                continue
            doc = node.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                continue
            head = textwrap.dedent("\n".join(lines[node.lineno - 1: doc.end_lineno]))
            if 40 <= len(head) <= 1500:
                out.append(head + "\n")
    random.Random(seed).shuffle(out)
    return out[:n]


def stdlib_text(n_chars: int, seed: int) -> str:
    files = stdlib_files()
    random.Random(seed + 1).shuffle(files)
    parts, total = [], 0
    for f in files:
        if total >= n_chars:
            break
        try:
            s = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        parts.append(s[:20000])
        total += len(parts[-1])
    return "\n\n".join(parts)[:n_chars]


def calibration_prompts(tok, max_per_workload: int | None) -> list[tuple[str, list[int]]]:
    """(kind, token ids) of the calibrate split of every workload; the holdout is never used."""
    from testbed.workloads import load_prompts, render, split_prompts

    out = []
    for name in ("humaneval", "mtbench", "alpaca"):
        prompts = split_prompts(load_prompts(name), "calibrate")[:max_per_workload]
        for p in prompts:
            text = render(p, tok)
            out.append((p.kind, tok.encode(text) if isinstance(text, str) else list(text)))
    return out


def _topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    v, i = lp.topk(k, dim=-1)
    return i.to(torch.int32), v.to(torch.float16)


@torch.inference_mode()
def generate_batch(target, prompts: list[list[int]], *, max_new: int, temperature: float, k: int,
                   eos: list[int], gen: torch.Generator) -> list[dict]:
    """The target's continuations of ``prompts``, recording top-k log-probs everywhere.

    Continuous batching as the real backend serves load (real/model/batch.py): every prompt owns
    a KV-cache row, and each step is one batched forward over the unfinished ones through the
    native kernels, which give each row the logits it gets served alone (a greedy continuation is
    the `ar` run's). A step samples the unfinished rows in prompt order from ``gen``."""
    from real.model.batch import CacheRows, Feed, forward_batch

    b, lens = len(prompts), [len(p) for p in prompts]
    rows = CacheRows(target, b, max(lens) + max_new)
    row_of, idx, lps, last = [], [], [], []
    for p in prompts:
        row_of.append(rows.acquire())
        logits = rows.prefill(row_of[-1], p, every_logit=True)
        i, v = _topk(logits, k)
        idx.append([i])
        lps.append([v])
        last.append(logits[-1])
    out_tokens: list[list[int]] = [[] for _ in range(b)]
    active = list(range(b))
    eos_set = set(eos)
    for step in range(max_new):
        logits = torch.stack([last[r] for r in active])
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
        for r, t in zip(active, nxt.tolist()):
            out_tokens[r].append(t)
        active = [r for r in active if out_tokens[r][-1] not in eos_set]
        if not active or step == max_new - 1:
            break
        feeds = [Feed(row_of[r], [out_tokens[r][-1]], lens[r] + step) for r in active]
        for r, lg in zip(active, forward_batch(target, feeds)):
            i, v = _topk(lg, k)
            idx[r].append(i)
            lps[r].append(v)
            last[r] = lg[-1]
    seqs = []
    for r in range(b):
        n_gen = len(out_tokens[r])
        # rows: prompt positions predict the next prompt token / the first generated token,
        # then one row per generated token except the last
        ii, vv = torch.cat(idx[r])[: lens[r] + n_gen - 1], torch.cat(lps[r])[: lens[r] + n_gen - 1]
        seqs.append({"tokens": torch.tensor(prompts[r] + out_tokens[r], dtype=torch.int32),
                     "idx": ii, "lp": vv, "n_prompt": lens[r], "kind": "gen"})
    return seqs


@torch.inference_mode()
def teacher_force_batch(target, chunks: list[list[int]], k: int) -> list[dict]:
    b, t = len(chunks), len(chunks[0])
    target.setup_cache(t, b)
    h = target.forward_layers(target.embed(torch.tensor(chunks)), 0)
    seqs = []
    for r in range(b):
        i, v = _topk(target.head(h[r: r + 1, :-1])[0], k)
        seqs.append({"tokens": torch.tensor(chunks[r], dtype=torch.int32), "idx": i, "lp": v,
                     "n_prompt": 0, "kind": "raw"})
    return seqs


def data_jobs(cfg: DictConfig, tok) -> list[tuple[str, str, object]]:
    """(shard name, kind, payload) for every teacher batch, in a fixed order."""
    d = cfg.data
    cap = d.max_prompts_per_workload
    prompts = [ids[-d.max_prompt_tokens:] for _, ids in calibration_prompts(tok, cap)]
    prompts += [tok.encode(p)[: d.max_prompt_tokens]
                for p in stdlib_function_prompts(d.stdlib_functions, cfg.seed)]
    prompts.sort(key=len)  # similar lengths per batch: little padding
    jobs: list[tuple[str, str, object]] = []
    for temp_name, temp, max_new in (("greedy", 0.0, d.max_new_tokens),
                                     ("sampled", 1.0, d.max_new_tokens_sampled)):
        if max_new <= 0:
            continue
        for j in range(0, len(prompts), d.gen_batch):
            jobs.append((f"{temp_name}_{j // d.gen_batch:04d}", f"gen:{temp}:{max_new}",
                         prompts[j: j + d.gen_batch]))
    if d.raw_tokens > 0:
        ids = tok.encode(stdlib_text(d.raw_tokens * 4, cfg.seed))[: d.raw_tokens]
        c = d.raw_chunk
        chunks = [ids[j: j + c] for j in range(0, len(ids) - c + 1, c)]
        for j in range(0, len(chunks), d.raw_batch):
            jobs.append((f"raw_{j // d.raw_batch:04d}", "raw", chunks[j: j + d.raw_batch]))
    return jobs


def build_teacher_data(cfg: DictConfig, data_dir: Path, *, limit: int | None = None,
                       workers: int = 1) -> list[Path]:
    """Run every teacher batch whose shard is not on disk yet; return all shard paths (the
    first ``limit`` batches only, when given). ``workers`` > 1: that many batches at once, each
    on its own copy of the target (a KV cache is the model's) in a thread of its own with one
    core (the native kernels run without the GIL; a batch's layers use one thread). A shard's
    content does not depend on which copy ran it: every batch draws from its own generator, and
    the kernels give each row the same logits however it is batched."""
    from queue import Queue

    from tqdm import tqdm

    from real.model.tokenizer import load_bundled_tokenizer
    from real.model.weights import load_model

    tok = load_bundled_tokenizer()
    jobs = data_jobs(cfg, tok)[:limit]
    paths = [data_dir / shard_name(name, kind, payload, cfg) for name, kind, payload in jobs]
    todo = [(n, kind, pl, p) for (n, kind, pl), p in zip(jobs, paths) if not p.is_file()]
    if not todo:
        return paths
    max_seq = cfg.data.max_prompt_tokens + cfg.data.max_new_tokens + 8
    targets: Queue = Queue()
    for _ in range(max(1, min(workers, len(todo)))):
        targets.put(load_model(max_seq=max_seq)[0])
    bar = tqdm(total=len(todo), desc="teacher data", unit="batch", dynamic_ncols=True, mininterval=5)

    def run(job: tuple[str, str, object, Path]) -> None:
        name, kind, payload, path = job
        target = targets.get()
        try:
            if kind == "raw":
                seqs = teacher_force_batch(target, payload, cfg.data.topk)
            else:
                _, temp, max_new = kind.split(":")
                gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + hash_name(name))
                seqs = generate_batch(target, payload, max_new=int(max_new), temperature=float(temp),
                                      k=cfg.data.topk, eos=tok.eos_token_ids, gen=gen)
        finally:
            targets.put(target)
        _atomic_save(seqs, path)
        bar.set_postfix_str(name, refresh=False)
        bar.update(1)

    if targets.qsize() == 1:
        for job in todo:
            run(job)
    else:
        map_in_threads(run, todo, targets.qsize())
    bar.close()
    return paths


def shard_name(name: str, kind: str, payload: object, cfg: DictConfig) -> str:
    """File name of a teacher batch: its content hash makes a changed config regenerate the
    batches it changes and reuse the rest (never a stale shard)."""
    import hashlib

    key = json.dumps([kind, payload, cfg.data.topk, cfg.seed], sort_keys=True)
    return f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"


def hash_name(name: str) -> int:
    return int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") % 1_000_000_007


# ------------------------------------------------------------------------------ packing
@dataclass
class Packed:
    tokens: Tensor  # [N] int64
    idx: Tensor  # [N, k] int64: teacher top-k ids for the token after position n
    lp: Tensor  # [N, k] fp32 teacher log-probs
    w: Tensor  # [N] loss weight (0 where no teacher row: last token of a document)


def pack(paths: list[Path], cfg: DictConfig) -> Packed:
    """All documents, shuffled by seed, concatenated into one stream."""
    docs = [s for p in sorted(paths) for s in torch.load(p, weights_only=False)]
    random.Random(cfg.seed).shuffle(docs)
    k = cfg.data.topk
    toks, idx, lp, w = [], [], [], []
    for d in docs:
        n = len(d["tokens"])
        ww = torch.full((n,), cfg.train.raw_weight if d["kind"] == "raw" else 1.0)
        ww[: max(0, d["n_prompt"] - 1)] *= cfg.train.prompt_weight  # rows predicting prompt tokens
        ww[n - 1] = 0.0
        toks.append(d["tokens"].long())
        idx.append(torch.cat([d["idx"].long(), torch.zeros(1, k, dtype=torch.long)]))
        lp.append(torch.cat([d["lp"].float(), torch.full((1, k), -30.0)]))
        w.append(ww)
    return Packed(torch.cat(toks), torch.cat(idx), torch.cat(lp), torch.cat(w))


def batch_at(data: Packed, step: int, *, rows: int, seq_len: int, seed: int) -> tuple[Tensor, ...]:
    """The batch of training step ``step``: a pure function of (data, step, seed), so a resumed
    run reads exactly what an uninterrupted one would."""
    n_rows = len(data.tokens) // seq_len
    sel = []
    for j in range(rows):
        g = step * rows + j
        epoch, off = divmod(g, n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        sel.append(int(perm[off]))
    ix = torch.tensor(sel)[:, None] * seq_len + torch.arange(seq_len)[None]
    return data.tokens[ix], data.idx[ix], data.lp[ix], data.w[ix]
