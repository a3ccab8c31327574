"""Our decoding against Hugging Face transformers on the same target, draft, prompts and length.

    .venv/bin/python benchmarks/bench_hf.py [--prompts 2] [--new-tokens 64] [--gamma 4]
                                            [--runs 2] [--threads N] [--cpus 0] [--dtype fp32]
                                            [--draft DIR] [--no-hf] [--out FILE.json]

Rows (greedy, batch 1, every row generates exactly ``--new-tokens`` tokens: EOS ignored):
- ours ``ar`` and ours ``sync`` (γ = ``--gamma``): ``real.runtime.engine.run`` on the experiment
  ``backend=real pair=smollm2_135m+smollm2_draft workload=humaneval`` (the testbed's own
  metric: generated tokens / decode wall time per request, prefill excluded, mean over requests);
- HF ``generate()``: transformers' LlamaForCausalLM loaded from the same bundled GGUF;
- HF assisted generation (``assistant_model=`` the project's draft as an HF LlamaForCausalLM),
  ``num_assistant_tokens_schedule`` ``"heuristic"`` (starting at γ in every call, +2 after a
  fully accepted round, -1 otherwise, with HF's default ``assistant_confidence_threshold``) and
  ``"constant"`` (γ every round, confidence threshold off: the same rule as our ``sync``).
  (transformers 5.x itself defaults to "constant", 20 tokens, threshold 0.4.)
HF rows exclude prefill the same way: (N - 1) tokens / (time of generate(N) - time of generate(1)).

Prompts: HumanEval (data/humaneval.jsonl, the ``holdout`` split, which the draft never saw)
through ``testbed.workloads.render``: code prompts are completion style, so they are fed as raw
text (no chat template), exactly as the real engine does;
HF receives the very token ids our tokenizer produced. The draft is ``models/smollm2-draft``
(``--draft``) when it exists; otherwise a *random* 3-layer LlamaForCausalLM with the target's
vocabulary is created in a temporary directory, for wiring only (it accepts almost nothing, so
its speculative rows then measure overhead, not speedup: the JSON says ``draft_is_random``).
Each figure is the best of ``--runs``; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_decode import conditions, cpu_name  # noqa: E402

DRAFT_DIR = ROOT / "models" / "smollm2-draft"


# ------------------------------------------------------------------------------ setup
def compose_exp(overrides: list[str]):  # -> testbed.config.ExperimentConfig
    """The experiment exactly as ``python -m testbed OVERRIDES`` would compose it."""
    from testbed.compose import compose_experiment

    return compose_experiment(overrides)


def random_draft_dir(tmp: Path) -> Path:
    """A random HF LlamaForCausalLM shaped like conf/model/smollm2_draft.yaml, with the target's
    tokenizer, saved as a checkpoint directory both loaders read (wiring only)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from real.model.weights import bundled_gguf_path

    gguf = bundled_gguf_path()
    config = LlamaConfig(vocab_size=49152, hidden_size=192, intermediate_size=1024, num_hidden_layers=3,
                         num_attention_heads=3, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    return tmp


# ------------------------------------------------------------------------------ ours
def ours(exp_overrides: list[str], runs: int) -> dict[str, dict]:
    """Best-of-``runs`` ``ar`` and ``sync`` through the real engine (one process: weights are
    loaded once and shared by both schedules)."""
    from real.runtime import engine
    from testbed.metrics import summarize

    out: dict[str, dict] = {}
    for schedule in ("ar", "sync"):
        # hydra applies the group choice (schedule=) before field overrides (schedule.gamma=)
        exp = compose_exp([*exp_overrides, f"schedule={schedule}", "real.baseline=false"])
        best: dict | None = None
        for _ in range(runs):
            result = engine.run(exp)
            rounds, requests, _ = result.recorder.frames()
            summary = summarize(rounds, requests, exp.schedule.gamma)
            if best is None or summary["tokens_per_s"] > best["tokens_per_s"]:
                best = summary
        assert best is not None
        out[schedule] = {"tokens_per_s": best["tokens_per_s"], "mean_accepted_len": best["mean_accepted_len"],
                         "alpha": best["alpha"], "gamma": exp.schedule.gamma if schedule == "sync" else None}
    return out


def prompt_token_ids(exp_overrides: list[str]) -> list[list[int]]:
    """The token ids the engine feeds for this workload (the same requests as ``ours``)."""
    from real.runtime.loading import build_requests, load

    exp = compose_exp([*exp_overrides, "schedule=ar"])
    t = exp.pair.target
    target, tok = load(t.path, "pair.target", model_name=t.name, dtype=exp.real.dtype)
    return [r.prompt_ids for r in build_requests(exp, tok, target.args.max_seq_len)]


# ------------------------------------------------------------------------------ HF
def hf_rows(prompts: list[list[int]], draft_dir: Path, *, new_tokens: int, gamma: int, runs: int,
            dtype: torch.dtype) -> dict[str, dict]:
    from transformers import AutoModelForCausalLM

    from real.model.weights import bundled_gguf_path

    gguf = bundled_gguf_path()
    target = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()

    def decode_tps(settings: dict | None = None, **kwargs) -> float:
        """Mean over prompts of (N - 1) / (t(N) - t(1)), each time the best of ``runs``.
        ``settings`` are applied to the draft's generation config before *every* call: HF's
        heuristic carries num_assistant_tokens over from call to call, which would make the
        calls (and the subtraction) start from different states."""
        rates = []
        for ids in prompts:
            x = torch.tensor([ids])

            def gen(n: int, x: torch.Tensor = x) -> float:
                best = float("inf")
                for _ in range(runs):
                    for key, value in (settings or {}).items():
                        setattr(draft.generation_config, key, value)
                    start = time.perf_counter()
                    with torch.inference_mode():
                        target.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        attention_mask=torch.ones_like(x), **kwargs)
                    best = min(best, time.perf_counter() - start)
                return best

            gen(2)  # warm-up
            rates.append((new_tokens - 1) / max(gen(new_tokens) - gen(1), 1e-9))
        return sum(rates) / len(rates)

    rows = {"hf_generate": {"tokens_per_s": decode_tps()}}
    schedules = {
        "hf_assisted_heuristic": {"num_assistant_tokens_schedule": "heuristic", "num_assistant_tokens": gamma},
        "hf_assisted_constant": {"num_assistant_tokens_schedule": "constant", "num_assistant_tokens": gamma,
                                 "assistant_confidence_threshold": 0.0},
    }
    for name, settings in schedules.items():
        rows[name] = {"tokens_per_s": decode_tps(settings, assistant_model=draft),
                      "settings": {"assistant_confidence_threshold": "HF default", **settings}}
    return rows


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2, help="HumanEval prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per round (sync, HF assisted)")
    ap.add_argument("--runs", type=int, default=2, help="best of this many runs per figure")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--cpus", default="", help="pin to these CPUs, e.g. 0 or 0,1 (like taskset -c)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--draft", default=str(DRAFT_DIR), help="HF checkpoint dir of the draft")
    ap.add_argument("--no-hf", action="store_true", help="only our rows")
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench" / "bench_hf.json"))
    args = ap.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    start = conditions()
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPUs {sorted(os.sched_getaffinity(0))}, {args.dtype}")
    print(f"start: {start}")
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = Path(args.draft)
        random_draft = not (draft_dir / "config.json").is_file()
        if random_draft:
            print(f"{draft_dir} not found: a RANDOM draft stands in (wiring only; speculation "
                  "rows measure overhead, not speedup)")
            draft_dir = random_draft_dir(Path(tmp))
        # held-out prompts: the trained draft learned from the `calibrate` split
        overrides = ["backend=real", "pair=smollm2_135m+smollm2_draft", "workload=humaneval",
                     "workload.split=holdout",
                     f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.new_tokens}",
                     f"schedule.gamma={args.gamma}", "real.ignore_eos=true", "real.progress=false",
                     f"real.threads={args.threads}", f"real.dtype={args.dtype}",
                     f"pair.draft.path={draft_dir}"]
        rows = ours(overrides, args.runs)
        if not args.no_hf:
            prompts = prompt_token_ids(overrides)
            rows.update(hf_rows(prompts, draft_dir, new_tokens=args.new_tokens, gamma=args.gamma, runs=args.runs, dtype=dtype))
    end = conditions()

    base = rows["ar"]["tokens_per_s"]
    print(f"\n{args.prompts} HumanEval prompts x {args.new_tokens} new tokens, greedy, batch 1, "
          f"gamma {args.gamma}, best of {args.runs}{' (RANDOM draft)' if random_draft else ''}")
    print(f"{'row':28s} {'tok/s':>8s} {'vs our ar':>10s}")
    for name, row in rows.items():
        print(f"{name:28s} {row['tokens_per_s']:8.1f} {row['tokens_per_s'] / base:9.2f}x")
    print(f"end: {end}")
    summary = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)),
               "dtype": args.dtype, "prompts": args.prompts, "new_tokens": args.new_tokens,
               "gamma": args.gamma, "runs": args.runs, "draft": str(args.draft),
               "draft_is_random": random_draft, "load_start": start, "load_end": end, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
