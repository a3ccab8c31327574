"""`python -m testbed backend=real +calibrate`: measure the latency tables of `sim.cost_model=profile`.

What is timed is what the real engine calls, at the experiment's real.threads (unset: one
thread, ``PROFILE_THREADS``, as the sweeps run) and real.dtype,
for greedy (temperature 0: argmax) and sampled (softmax + draw over the vocabulary) decoding:

- target: ``TargetRunner.probs`` over k = 1..32 tokens at several context lengths (the cached
  tokens before them), Algorithm 1 (``speculative_step``) per k, and prefill per prompt length;
- every available draft (the pair's, and every model preset that can draft for this target:
  early-exit layers, prompt lookup, small models whose weights exist): one forward + the pick
  of its guess at k = 1..4 tokens and the same contexts, its prefill, or for prompt lookup the
  whole ``propose`` per context length;
- batched forwards (continuous batching): B requests x k tokens at one context, per model
  (real/calibrate/batch.py);
- forward latency at every TP degree the machine allows (1 and 2 on two cores), chain- and
  tree-shaped, all-reduce latency against size and the round trip between two pinned workers
  (real/calibrate/tp.py; ``tp=False`` skips it);
- messages between two worker processes (torch.distributed gloo on loopback): one-way time
  for a few sizes and its α–β fit (latency + bytes / bandwidth); on two cores also the async
  bridge as an async run uses it, the sender computing (real/calibrate/bridge.py).

Every probe is timed once per pass, passes interleave all probes in random order, and a point
is the median over passes (a burst of load from a neighbour spoils one sample of many probes,
not all samples of one). Forward tables are then smoothed robustly — per k a Theil–Sen line in
the context length (attention cost is linear in it), then non-decreasing in k (pool adjacent
violators) — and the raw medians are kept beside them. The profile is
written atomically to reports/profiles/<hardware>.json (or sim.profile_path) and copied into
the run directory. Measurements made while other processes load the CPU are noisy: the profile
records the load average before and after, and calibration can be rerun in a few minutes.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from real.calibrate.drafts import TEMPERATURES, drafts_to_measure, picker
from real.calibrate.drafts import make_draft as _make_draft
from real.calibrate.fit import isotonic, smooth_table
from real.calibrate.links import measure_messages
from real.calibrate.machine import load_average, machine_facts
from real.calibrate.probe_forward import evict_caches
from real.model.runners import sync_device
from testbed.config import ExperimentConfig, ModelConfig, real_dtype
from testbed.paths import profile_path as testbed_profile_path
from testbed.paths import repo_path, timed_code_digest

SCHEMA = 2  # 2: per-model "tp" tables, "allreduce", links.gloo_round_trip (real/calibrate/tp.py)
# real.threads=0 (torch's default): one intra-op thread, as a device is one core to the sweeps
# (`real.threads: 1` in conf/sweep/) and to every multi-process worker, so that the profile
# `+calibrate` writes is the one the README's sweeps read
PROFILE_THREADS = 1


@dataclass
class Grid:
    target_k: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32])
    draft_k: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    context: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])
    prompt_len: list[int] = field(default_factory=lambda: [16, 64, 128, 256, 512])  # beyond: linear
    gammas: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # n-gram propose
    repeats: int = 7  # interleaved passes over every probe; the median is kept
    message_bytes: list[int] = field(default_factory=lambda: [4, 1024, 16384, 262144, 1048576, 4194304])
    message_repeats: int = 20
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])  # continuous batching
    batch_target_k: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    batch_draft_k: list[int] = field(default_factory=lambda: [1, 2])

    @classmethod
    def quick(cls) -> Grid:
        """A tiny grid for tests."""
        return cls(target_k=[1, 2, 4], draft_k=[1, 2], context=[16, 48], prompt_len=[8, 32],
                   gammas=[1, 4], repeats=2, message_bytes=[], message_repeats=0, batches=[1, 2],
                   batch_target_k=[1, 2], batch_draft_k=[1])


class Probes:
    """Timed calls, measured in interleaved passes: every pass times every probe once, in a
    fresh random order, and a probe's value is its median over passes. A burst of load from
    another process (seconds long on a shared machine) then spoils one sample of many probes
    instead of every sample of a few."""

    def __init__(self) -> None:
        self.fns: dict[tuple, Callable[[], Any]] = {}
        self.samples: dict[tuple, list[float]] = {}
        self.cold: set[tuple] = set()

    def add(self, key: tuple, fn: Callable[[], Any], *, cold: bool = False) -> None:
        """``cold``: time the call after ``evict_caches`` (a draft model's forwards: in a run they
        follow the target's, and the run's probes time them so; see probe_forward.evict_caches)."""
        self.fns[key] = fn
        if cold:
            self.cold.add(key)

    def run(self, passes: int, seed: int = 0, log: Callable[[str], None] | None = None) -> None:
        import random

        keys = list(self.fns)
        for k in keys:  # warm-up (allocations, first-touch)
            self.fns[k]()
        rng = random.Random(seed)
        for i in range(passes):
            rng.shuffle(keys)
            for k in keys:
                if k in self.cold:
                    evict_caches()
                sync_device()
                t = time.perf_counter()
                self.fns[k]()
                sync_device()
                self.samples.setdefault(k, []).append(time.perf_counter() - t)
            if log is not None:
                log(f"pass {i + 1}/{passes} done (load {load_average()})")

    def value(self, key: tuple) -> float:
        return statistics.median(self.samples[key])


# ------------------------------------------------------------------------------------ models
def _tokens(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(vocab, (n,), generator=gen).tolist()


def add_target_probes(pr: Probes, model: Any, grid: Grid) -> Callable[[], dict[str, Any]]:
    """Register the target's probes; returns the function that builds its table afterwards."""
    from real.model.runners import TargetRunner
    from testbed.spec.sampling import SamplingParams, standardize
    from testbed.spec.speculative import speculative_step

    vocab = model.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    need = max(max(grid.context) + max(grid.target_k), max(grid.prompt_len)) + 2
    if model.max_seq < need:
        model.setup_cache(need)
    for cls, temp in TEMPERATURES.items():
        runner = TargetRunner(model, SamplingParams(temperature=temp))
        params = SamplingParams(temperature=temp)
        for c in grid.context:
            for k in grid.target_k:
                toks = _tokens(k, vocab, gen)
                pr.add(("target", cls, k, c), lambda r=runner, toks=toks, c=c: r.probs(toks, c))
        for k in grid.target_k:  # Algorithm 1 over k-1 guesses, realistic p and q
            p = standardize(torch.randn(k, vocab, generator=gen), params)
            q = standardize(torch.randn(k - 1, vocab, generator=gen), params)
            guesses = q.argmax(dim=-1) if k > 1 else torch.zeros(0, dtype=torch.long)
            pr.add(("accept", cls, k), lambda p=p, q=q, g=guesses: speculative_step(p, q, draft_tokens=g, generator=gen))
        # `ar` picks its token from p directly (argmax, or one draw) instead of Algorithm 1
        p1 = standardize(torch.randn(vocab, generator=gen), params)
        pick_fn = picker(temp == 0.0, gen)
        pr.add(("pick", cls), lambda p1=p1, f=pick_fn: f(p1))
    runner = TargetRunner(model, SamplingParams())
    for n in grid.prompt_len:
        ids = _tokens(n, vocab, gen)
        pr.add(("prefill", n), lambda ids=ids: runner.prefill(ids))

    def build() -> dict[str, Any]:
        forward, accept, pick = {}, {}, {}
        for cls in TEMPERATURES:
            raw = [[pr.value(("target", cls, k, c)) for k in grid.target_k] for c in grid.context]
            forward[cls] = {"k": grid.target_k, "context": grid.context,
                            "seconds": smooth_table(raw, grid.context), "raw": raw}
            acc = [pr.value(("accept", cls, k)) for k in grid.target_k]
            accept[cls] = {"k": grid.target_k, "seconds": isotonic(acc), "raw": acc}
            pick[cls] = pr.value(("pick", cls))
        pf = [pr.value(("prefill", n)) for n in grid.prompt_len]
        return {"kind": "transformer", "role": "target", "layers": model.args.n_layers,
                "forward": forward, "accept": accept, "pick": pick,
                "prefill": {"prompt_len": grid.prompt_len, "seconds": isotonic(pf), "raw": pf}}
    return build


def add_draft_probes(pr: Probes, cfg: ModelConfig, *, vocab: int, grid: Grid, prompt: list[int],
                     make: Callable[[float], Any]) -> Callable[[], dict[str, Any]]:
    name = cfg.name
    gen = torch.Generator().manual_seed(1)
    if cfg.kind == "ngram":
        draft = make(0.0)
        for c in grid.context:
            ids = (prompt * (c // max(1, len(prompt)) + 1))[:c]
            for g in grid.gammas:
                pr.add((name, "propose", c, g), lambda ids=ids, g=g: draft.propose(ids, g, gen))

        def build_ngram() -> dict[str, Any]:
            rows = [statistics.median(pr.value((name, "propose", c, g)) for g in grid.gammas)
                    for c in grid.context]
            table = {"context": grid.context, "seconds": isotonic(rows), "raw": rows}
            # q is one-hot whatever the temperature: one table serves both classes
            return {"kind": "ngram", "role": "draft", "propose": {cls: table for cls in TEMPERATURES}}
        return build_ngram
    for cls, temp in TEMPERATURES.items():
        d = make(temp)
        model = getattr(d, "model", None)
        model = getattr(d, "target", None) if model is None else model
        need = max(max(grid.context) + max(grid.draft_k), max(grid.prompt_len)) + 2
        if model is not None and model.max_seq < need:
            model.setup_cache(need)
        pick = picker(temp == 0.0, gen)
        for c in grid.context:
            for k in grid.draft_k:
                toks = _tokens(k, vocab, gen)
                pr.add((name, cls, k, c), lambda d=d, toks=toks, c=c, f=pick: f(d.forward_probs(toks, c)),
                       cold=True)
    if cfg.kind == "transformer":  # an early-exit draft shares the target's prefill
        d0 = make(0.0)
        for n in grid.prompt_len:
            ids = _tokens(n, vocab, gen)
            pr.add((name, "prefill", n), lambda ids=ids: d0.start(ids), cold=True)

    def build() -> dict[str, Any]:
        forward = {}
        for cls in TEMPERATURES:
            raw = [[pr.value((name, cls, k, c)) for k in grid.draft_k] for c in grid.context]
            forward[cls] = {"k": grid.draft_k, "context": grid.context,
                            "seconds": smooth_table(raw, grid.context), "raw": raw}
        out: dict[str, Any] = {"kind": cfg.kind, "role": "draft", "forward": forward,
                               "layers": cfg.exit_layer if cfg.kind == "early_exit" else cfg.layers}
        if cfg.kind == "transformer":
            pf = [pr.value((name, "prefill", n)) for n in grid.prompt_len]
            out["prefill"] = {"prompt_len": grid.prompt_len, "seconds": isotonic(pf), "raw": pf}
        return out
    return build


# --------------------------------------------------------------------------------------- run
def profile_path(exp: ExperimentConfig) -> Path:
    return testbed_profile_path(exp)


def calibrate(exp: ExperimentConfig, run_dir: Path | None = None, *, grid: Grid | None = None,
              log: Callable[[str], None] = print, messages: bool = True,
              out_path: Path | None = None, tp: bool = True, tp_grid: Any = None) -> Path:
    """Measure and write the profile; returns its path. ``tp``: also the multi-process tables
    (real/calibrate/tp.py, ``tp_grid`` a ``TpGrid``; skipped on a machine with one core)."""
    from real.calibrate.probe_forward import probe_functions, time_functions
    from real.model.weights import load_model
    from testbed.machine import probe_record
    from testbed.results import write_json
    from testbed.spec.sampling import SamplingParams

    grid = grid or Grid()
    from real.runtime.loading import DTYPES as dtypes
    from real.runtime.loading import attach_graphs, model_device
    started = time.perf_counter()
    load_before = load_average()
    probe_before = probe_record()  # the machine's speed now (sim.profile_drift=probe)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(exp.real.threads or PROFILE_THREADS)
    try:
        with torch.inference_mode():
            t = exp.pair.target
            target, tokenizer = load_model(None if t.path is None else repo_path(t.path),
                                           dtype=dtypes[real_dtype(exp)], device=model_device(exp),
                                           max_seq=64)
            # the forwards the runs use: CUDA-graph replays where real.cuda_graphs is on
            attach_graphs(target, exp.real.cuda_graphs)
            log(f"calibrating {t.name} on {exp.hardware.name}: {torch.get_num_threads()} threads, {real_dtype(exp)}")
            pr = Probes()
            builders = {t.name: add_target_probes(pr, target, grid)}
            prompt = _sample_prompt(tokenizer)
            for d in drafts_to_measure(exp):
                try:
                    def make(temp: float, d: ModelConfig = d) -> Any:
                        return _make_draft(exp, d, target, tokenizer, params=SamplingParams(temperature=temp))
                    builders[d.name] = add_draft_probes(pr, d, vocab=target.args.vocab_size, grid=grid, prompt=prompt, make=make)
                except Exception as e:  # noqa: BLE001 - one unusable draft must not lose the rest
                    log(f"draft {d.name}: skipped ({type(e).__name__}: {e})")
            # batched forwards (continuous batching) in the same passes: interleaved with the
            # one-request probes, they are timed in the same regime as the tables a run's probe
            # forward corrects (real/calibrate/batch.py)
            from real.calibrate.batch import add_batch_probes, add_eagle_batch_probes
            from real.model.eagle import EagleDraft

            batched = {t.name: ("target", target)}
            for d in drafts_to_measure(exp):
                if d.kind in ("transformer", "eagle") and d.name in builders:
                    batched[d.name] = ("draft", _make_draft(exp, d, target, tokenizer, params=SamplingParams()))
            batch_builders = {
                name: add_eagle_batch_probes(pr, model, name=name, batches=grid.batches, ks=grid.batch_draft_k)
                if isinstance(model, EagleDraft) else
                add_batch_probes(pr, getattr(model, "model", model), name=name, role=role, batches=grid.batches,
                                 ks=grid.batch_target_k if role == "target" else grid.batch_draft_k)
                for name, (role, model) in batched.items()}
            log(f"{len(pr.fns)} probes x {grid.repeats} interleaved passes; models: {', '.join(builders)}")
            # the probe a prediction repeats to correct for drift (sim.profile_drift=forward),
            # around the tables it stands for
            fwd = probe_functions(exp, target, tokenizer, [d for d in drafts_to_measure(exp) if d.name in builders])
            drafts_cold = [m for m in fwd if m != exp.pair.target.name]  # as forward_probe times them
            fwd_before = time_functions(fwd, cold=drafts_cold)
            pr.run(grid.repeats, log=log)
            fwd_after = time_functions(fwd, cold=drafts_cold)
            models = {name: build() for name, build in builders.items()}
            for name, build in batch_builders.items():
                models[name]["batch"] = build()
            from real.calibrate.sampling import add_sampling_tables  # per mode: top-k/top-p extra
            add_sampling_tables(exp, target, prompt=prompt, models=models, drafts=drafts_to_measure(exp), log=log)
            from real.calibrate.tree import (  # tree expansions
                add_eagle_tree_tables,
                add_ngram_tree_tables,
                add_tree_tables,
            )
            add_tree_tables(models, drafts_to_measure(exp), dtypes[real_dtype(exp)], log=log)
            add_eagle_tree_tables(models, drafts_to_measure(exp), log=log,
                                  make=lambda d: _make_draft(exp, d, target, tokenizer, params=SamplingParams()))
            add_ngram_tree_tables(models, drafts_to_measure(exp), target.args.vocab_size, log=log)
            _log_tables(models, log)
            threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    links = {}
    if messages and grid.message_bytes:
        try:
            links["gloo_loopback"] = measure_messages(grid.message_bytes, grid.message_repeats)
            lk = links["gloo_loopback"]
            log(f"messages (gloo loopback): α={1e6 * lk['alpha_s']:.1f} µs, "
                f"{lk['bandwidth_gbps'] or float('inf'):.2f} GB/s")
        except Exception as e:  # noqa: BLE001 - the forward tables are still useful
            log(f"messages: skipped ({type(e).__name__}: {e})")
    if messages and len(os.sched_getaffinity(0)) >= 2:
        from real.calibrate.bridge import measure_bridge
        try:  # the async bridge as an async run uses it (the sender computing)
            links["bridge"] = measure_bridge(exp, log=log)
        except Exception as e:  # noqa: BLE001 - the forward tables are still useful
            log(f"bridge messages: skipped ({type(e).__name__}: {e})")
    tp_part = _measure_tp(exp, models, tp_grid, log) if tp else {}
    for name, tables in tp_part.get("models", {}).items():
        models[name].update(tables)
    if "round_trip" in tp_part:
        links["gloo_round_trip"] = tp_part["round_trip"]["gloo_loopback"]
    probe_after = probe_record()
    profile = {
        "schema": SCHEMA, "kind": "testbed-latency-profile", "hardware": exp.hardware.name,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "code": timed_code_digest(),  # the sources it timed: other code makes it stale
        "machine": machine_facts(), "torch": torch.__version__, "threads": threads,
        "cores": len(os.sched_getaffinity(0)),  # the cores it could use: TP degrees up to this
        "dtype": real_dtype(exp), "device": exp.real.device, "statistic": "median",
        "repeats": grid.repeats, "load_average": {"before": load_before, "after": load_average()},
        "probe": {"gbps": round((probe_before["gbps"] + probe_after["gbps"]) / 2, 3),
                  "before": probe_before, "after": probe_after,
                  "forward_s": {m: round((fwd_before[m] + fwd_after[m]) / 2, 7) for m in fwd_before},
                  "forward_before_s": fwd_before, "forward_after_s": fwd_after},
        "calibration_s": round(time.perf_counter() - started, 1),
        "models": models, "links": links,
        **{k: tp_part[k] for k in ("allreduce", "tp_allreduce", "tp_calibration_s") if k in tp_part},
    }
    path = out_path or profile_path(exp)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, profile)
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(run_dir) / "profile.json")
    log(f"profile: {path} ({profile['calibration_s']} s)")
    return path


def _measure_tp(exp: ExperimentConfig, models: dict[str, Any], grid: Any,
                log: Callable[[str], None]) -> dict[str, Any]:
    """The TP tables of the target and every draft model measured above, and how much they slow
    each other on two cores (real/calibrate/contention.py), when the machine has two cores."""
    from real.calibrate.contention import add_contention
    from real.calibrate.tp import measure_tp

    if exp.real.device != "cpu":  # the two workers time CPU cores: not this device's shapes
        log(f"tensor-parallel tables: skipped (real.device={exp.real.device}: the two pinned workers "
            "time CPU cores)")
        return {}
    if len(os.sched_getaffinity(0)) < 2:
        log("tensor-parallel tables: skipped (one core: TP 1 only)")
        return {}
    paths = {exp.pair.target.name: exp.pair.target.path}
    paths.update({d.name: d.path for d in drafts_to_measure(exp)
                  if d.kind == "transformer" and d.name in models})
    try:
        part = measure_tp(exp, paths, grid, log=log)
    except Exception as e:  # noqa: BLE001 - the TP 1 tables are still useful
        log(f"tensor-parallel tables: skipped ({type(e).__name__}: {e})")
        part = {}
    # async's two cores: the draft models, and an eagle head (not sharded: no TP tables of its own)
    heads = {d.name: d.path for d in drafts_to_measure(exp) if d.kind == "eagle" and d.name in models}
    add_contention(exp, part.setdefault("models", {}), paths={**paths, **heads}, log=log, tp_grid=grid)
    return part


def _log_tables(models: dict[str, Any], log: Callable[[str], None]) -> None:
    for name, m in models.items():
        if "forward" in m:
            for cls, t in m["forward"].items():
                for c, row in zip(t["context"], t["seconds"]):
                    log(f"{name} {cls} context={c}: " + " ".join(f"k{k}={1e3 * v:.1f}" for k, v in zip(t["k"], row)) + " ms")
        if "propose" in m:
            t = m["propose"]["greedy"]
            log(f"{name} propose: " + " ".join(f"c{c}={1e6 * v:.0f}" for c, v in zip(t["context"], t["seconds"])) + " µs")
        if "batch" in m:
            t = m["batch"]["greedy"]
            for b, row in zip(t["batch"], t["seconds"]):
                log(f"{name} batch={b} context={t['context']}: " + " ".join(
                    f"k{k}={1e3 * v:.1f}" for k, v in zip(t["k"], row)) + " ms")
        if "prefill" in m:
            t = m["prefill"]
            log(f"{name} prefill: " + " ".join(f"{n}={1e3 * v:.0f}" for n, v in zip(t["prompt_len"], t["seconds"])) + " ms")


def _sample_prompt(tokenizer: Any) -> list[int]:
    """Real token ids for the n-gram lookup (its cost depends on how soon a match is found)."""
    try:
        from testbed.workloads import load_prompts

        text = "\n".join(p.text for p in load_prompts("humaneval")[:4])
        return list(tokenizer.encode(text))
    except Exception:  # noqa: BLE001 - any text will do
        return list(range(1000, 1400))
