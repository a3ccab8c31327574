"""Lookahead policies on the real backend (issue 14): paired tokens/s and the classifier's cost.

1. Cost per draft token of the per-token decision, as a share of one draft forward of the
   bundled draft: the DISCO classifier alone (a 12 -> 32 -> 1 FFN in numpy), with the feature
   extraction (top-10 and entropy over the 49k vocabulary) it needs, and the confidence
   policy's one feature (the chosen token's probability: one logsumexp).
2. Paired runs: every policy on the same prompts (``workload.split=test``), interleaved round
   by round (``--rounds``) so drift on a shared machine hits all alike; per policy the median
   tokens/s, and per round the ratio of DISCO, confidence, heuristic and the oracle to
   static-opt (the best static γ *of that round*) — reported as the median ratio.

    taskset -c 1 python benchmarks/bench_lookahead.py --workload humaneval --prompts 8 --tokens 96 --rounds 3
    taskset -c 1 python benchmarks/bench_lookahead.py --workload mtbench ...   # transfer: DISCO trained on HumanEval
    taskset -c 1 python benchmarks/bench_lookahead.py --dtype fp32 ...   # verification ~ one token's cost
    python benchmarks/bench_lookahead.py --cost-only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from testbed.paths import repo_path

STATIC = (1, 2, 3, 4, 5, 6, 8)
DISCO_PATH = "models/disco/smollm2_135m+smollm2_draft.json"


def _compose(overrides: list[str]):  # type: ignore[no-untyped-def]
    from real.train.disco import _compose as compose

    return compose(overrides)


def classifier_cost(repeats: int = 300) -> dict:
    """Seconds per draft token: classifier, features, one draft forward (best of 5 batches)."""
    from real.model.drafts import ModelDraft
    from real.runtime.loading import load
    from testbed.spec.lookahead import DiscoLookahead, draft_token_features, load_classifier
    from testbed.spec.sampling import SamplingParams

    exp = _compose(["backend=real", "pair=smollm2_135m+smollm2_draft"])
    d = exp.pair.draft
    model, _ = load(d.path, "pair.draft", model_name=d.name, dtype=exp.real.dtype)
    model.setup_cache(512)
    draft = ModelDraft(model, SamplingParams(), d.name)
    draft.start(list(range(1000, 1200)))
    policy = DiscoLookahead(8, classifier=load_classifier(DISCO_PATH), threshold=0.5)
    logits = draft._logits([5], 199)
    feats = draft_token_features(logits, int(logits.argmax()))

    def best(fn, n: int) -> float:  # type: ignore[no-untyped-def]
        out = []
        for _ in range(5):
            s = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - s) / n)
        return min(out)

    with torch.inference_mode():
        fwd = best(lambda: draft._logits([5], 199), 20)
    clf = best(lambda: policy.after_token(features=feats, position=3), repeats)
    fea = best(lambda: draft_token_features(logits, 5), 50)
    chosen = best(lambda: draft_token_features(logits, 5, chosen_only=True), 50)
    return {"draft_forward_ms": 1e3 * fwd, "classifier_us": 1e6 * clf, "features_us": 1e6 * fea,
            "classifier_share": clf / fwd, "classifier_plus_features_share": (clf + fea) / fwd,
            "confidence_chosen_prob_share": chosen / fwd}


def policies(pair: str, disco_sl: int) -> list[tuple[str, list[str]]]:
    out = [(f"static{g}", ["lookahead=static", f"schedule.gamma={g}"]) for g in STATIC]
    out += [("heuristic", ["lookahead=heuristic", "schedule.gamma=8"]),
            ("confidence", ["lookahead=confidence", "schedule.gamma=8"]),
            ("disco", ["lookahead=disco", f"schedule.gamma={disco_sl}"]),
            ("oracle", ["lookahead=oracle", "schedule.gamma=8"])]
    return out


def paired(args: argparse.Namespace) -> dict:
    from real.runtime.engine import run

    sl = json.loads(repo_path(DISCO_PATH).read_text())["sl_max"]
    base = ["backend=real", f"pair={args.pair}", f"workload={args.workload}", "workload.split=test",
            f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.tokens}",
            "real.ignore_eos=true", "real.baseline=false", "real.progress=false", "real.threads=1",
            "sampling.temperature=0", f"real.dtype={args.dtype}"]
    tps: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for r in range(args.rounds):
        this = {}
        for name, ov in policies(args.pair, sl):
            res = run(_compose([*base, *ov]))
            reqs = res.recorder.requests
            this[name] = sum(x["generated"] for x in reqs) / sum(x["decode_s"] for x in reqs)
            tps.setdefault(name, []).append(this[name])
        opt = max(v for k, v in this.items() if k.startswith("static"))
        for k in ("disco", "confidence", "heuristic", "oracle"):
            ratios.setdefault(f"{k}/static-opt", []).append(this[k] / opt)
        ratios.setdefault("disco/heuristic", []).append(this["disco"] / this["heuristic"])
        ratios.setdefault("confidence/heuristic", []).append(this["confidence"] / this["heuristic"])
        print(f"round {r}: " + " ".join(f"{k} {v:.1f}" for k, v in this.items()), flush=True)
    return {"tokens_per_s_median": {k: statistics.median(v) for k, v in tps.items()},
            "ratio_median": {k: statistics.median(v) for k, v in ratios.items()},
            "ratio_all": ratios, "setup": vars(args)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="smollm2_135m+smollm2_draft")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="real.dtype of the runs (fp32: forwards of up to ~8 tokens cost about one token's)")
    ap.add_argument("--cost-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    np.set_printoptions(precision=3)
    out = {"cost": classifier_cost()}
    print(json.dumps(out["cost"], indent=1), flush=True)
    if not args.cost_only:
        out["paired"] = paired(args)
        print(json.dumps({k: out["paired"][k] for k in ("tokens_per_s_median", "ratio_median")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
