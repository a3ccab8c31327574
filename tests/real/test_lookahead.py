"""Lookahead policies (testbed/spec/lookahead.py) on both backends: lossless at temperature 0
(token for token `ar`) and 1 (the target's law with γ varying per round), the oracle drafts
exactly what the target accepts, the trace replays recorded per-token features, and a bad
classifier file or option fails with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from real.model.decoder import ModelArgs, Transformer
from real.model.drafts import ModelDraft, NgramDraft
from real.model.runners import prefill
from real.runtime.context import RealRequest
from real.schedules.ar import serve_ar
from real.schedules.sync import serve_sync
from testbed.config import ConfigError
from testbed.spec.lookahead import CHOSEN, FEATURES, Decision, DiscoClassifier, make_lookahead
from testbed.spec.sampling import SamplingParams, standardize
from tests.conftest import compose_exp, run_cli
from tests.helpers.real_models import TINY, tiny
from tests.real.test_real_engine import _ctx, _outputs

POLICIES = ("static", "heuristic", "confidence", "disco", "oracle")


def position_classifier(path, stop_at: int = 3) -> str:  # type: ignore[no-untyped-def]
    """A DISCO file whose confidence falls with the position and rises with the chosen
    probability's rank-1 mass: confident for i < stop_at, not from stop_at on (entropy-free)."""
    w1 = np.zeros((2, FEATURES), dtype=np.float32)
    w1[0, FEATURES - 1] = -1.0  # the position input (Concat(top-k, entropy, i): i is last)
    w1[1, 0] = 1.0  # top-1 probability
    clf = DiscoClassifier(mean=np.zeros(FEATURES, np.float32), std=np.ones(FEATURES, np.float32), w1=w1,
                          b1=np.asarray([stop_at - 0.5, 0.0], np.float32), w2=np.asarray([4.0, 0.1], np.float32),
                          b2=-0.05, threshold=0.5, sl_max=4)
    path.write_text(json.dumps(clf.to_json()))
    return str(path)


def noisy_copy(scale: float, seed: int = 7) -> Transformer:
    """The tiny target with noise on its matrices: a draft that agrees with it often, not always."""
    d = tiny(0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return d


def _requests(n: int = 4, new: int = 24) -> list[RealRequest]:
    gen = torch.Generator().manual_seed(1)
    return [RealRequest(i, f"p{i}", torch.randint(0, TINY.vocab_size, (5 + 3 * i,), generator=gen).tolist(), new)
            for i in range(n)]


def _policy_exp(policy: str, tmp_path, gamma: int = 5, threshold: float | None = None,  # type: ignore[no-untyped-def]
                split: str = "all"):
    extra = [f"workload.split={split}"]
    if policy == "disco":
        extra.append(f"lookahead.path={position_classifier(tmp_path / 'clf.json')}")
    if threshold is not None:
        extra.append(f"lookahead.threshold={threshold}")
    return compose_exp(f"schedule.gamma={gamma}", f"lookahead={policy}", "acceptance=synthetic", *extra)


# ------------------------------------------------------------------------------ real backend
@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("policy", POLICIES)
def test_real_every_policy_equals_ar_at_temperature_0(policy: str, kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    params, target, reqs = SamplingParams(), tiny(0), _requests()
    ar = _outputs(_ctx(compose_exp(), target, None, params), serve_ar, reqs)

    def draft():  # type: ignore[no-untyped-def]
        return ModelDraft(noisy_copy(0.005), params, "d") if kind == "model" else NgramDraft(2, TINY.vocab_size)

    threshold = None
    if policy == "confidence":  # the median chosen-token probability: some windows stop early
        probe = _ctx(_policy_exp("static", tmp_path, split="trace"), target, draft(), params)  # records features
        _outputs(probe, serve_sync, reqs[:2])
        chosen = [f[i + CHOSEN] for f in probe.rec.frames()[0].draft_features for i in range(0, len(f), FEATURES)]
        threshold = float(np.median(chosen)) if kind == "model" else None
    ctx = _ctx(_policy_exp(policy, tmp_path, threshold=threshold), target, draft(), params)
    assert _outputs(ctx, serve_sync, reqs) == ar
    rounds = ctx.rec.frames()[0]
    assert (rounds.accepted <= rounds.drafted).all() and (rounds.drafted <= 5).all()
    if kind == "model" and policy in ("confidence", "oracle"):
        assert rounds.drafted.nunique() > 1, rounds.drafted.value_counts()  # γ varied per round
    if policy == "disco" and kind == "model":
        assert rounds.drafted.max() <= 3  # the classifier stops at position 3


def test_oracle_drafts_exactly_what_the_target_accepts_at_temperature_0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Never a rejected guess; a window shorter than γ ends where the draft's next guess would
    have been rejected (checked against `ar`'s output with a fresh copy of the draft)."""
    params, target, reqs, gamma = SamplingParams(), tiny(0), _requests(new=32), 5
    ar = _outputs(_ctx(compose_exp(), target, None, params), serve_ar, reqs)
    ctx = _ctx(_policy_exp("oracle", tmp_path, gamma=gamma), target, ModelDraft(noisy_copy(0.005), params, "d"), params)
    assert _outputs(ctx, serve_sync, reqs) == ar
    rounds = ctx.rec.frames()[0]
    assert (rounds.accepted == rounds.drafted).all()  # never a guess the target rejects
    checker = noisy_copy(0.005)
    short = 0
    for req, out in zip(reqs, ar):
        done = 0
        for r in rounds[rounds.request_id == req.request_id].itertuples():
            k = int(r.drafted)
            if k < gamma and done + k < len(out):
                logits = prefill(checker, req.prompt_ids + out[:done + k], last_logits=True)
                assert int(logits.argmax()) != out[done + k]  # the next guess would be rejected
                short += 1
            done += int(r.emitted)
    assert short > 0 and (rounds.drafted == gamma).any() and (rounds.drafted > 0).any()


def test_a_varying_window_still_samples_the_target_distribution_at_temperature_1(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The statistical test of test_real_engine with the confidence policy (γ varies per round)."""
    vocab = 4
    args_t = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=vocab,
                       rope_theta=10000.0, max_seq_len=16)
    target = Transformer(args_t).init_random(11, std=0.8)
    target.setup_cache()
    draft_model = Transformer(args_t).init_random(12, std=0.8)
    draft_model.setup_cache()
    params = SamplingParams(temperature=1.0)
    prompt = [0, 1, 2]

    def dist(model: Transformer) -> torch.Tensor:  # exact P(x1, x2 | prompt)
        with torch.inference_mode():
            model.truncate(0)
            p1 = standardize(model(torch.tensor([prompt]), input_pos=0)[0, -1], params)
            out = torch.zeros(vocab, vocab)
            for a in range(vocab):
                p2 = standardize(model(torch.tensor([[a]]), input_pos=len(prompt))[0, -1], params)
                out[a] = p1[a] * p2
        return out.flatten()

    p_exact, q_exact = dist(target), dist(draft_model)
    assert 0.5 * (p_exact - q_exact).abs().sum() > 0.25
    exp = compose_exp("schedule.gamma=3", "seed=5", "lookahead=confidence", "lookahead.threshold=0.45",
                      "acceptance=synthetic")
    ctx = _ctx(exp, target, ModelDraft(draft_model, params, "q"), params)
    n = 3000
    for i in range(n):
        serve_sync(ctx, RealRequest(i, "p", prompt, 2))
    counts = torch.zeros(vocab * vocab)
    for r in ctx.rec.requests:
        a, b = r["output_ids"]
        counts[a * vocab + b] += 1
    tv = 0.5 * (counts / n - p_exact).abs().sum()
    assert tv < 0.05, tv
    rounds = ctx.rec.frames()[0]
    assert rounds.drafted.nunique() > 1 and rounds.accepted.mean() > 0  # γ varied; guesses were kept


# ------------------------------------------------------------------------------ simulator
@pytest.mark.parametrize("policy", POLICIES)
def test_sim_every_policy_equals_ar_at_temperature_0(policy: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sim.runtime.engine import run

    extra = ["lookahead.threshold=0.2"] if policy == "confidence" else []
    exp = _policy_exp(policy, tmp_path, gamma=6)
    exp = compose_exp("schedule.gamma=6", f"lookahead={policy}", "acceptance=synthetic", "workload.num_prompts=3",
                      "workload.max_new_tokens=48", "sampling.temperature=0", *extra,
                      *([f"lookahead.path={exp.lookahead.path}"] if policy == "disco" else []))
    result = run(exp)
    assert [r["output_ids"] for r in result.recorder.requests] == [r["output_ids"] for r in result.baseline.requests]
    rounds = result.recorder.frames()[0]
    if policy == "oracle":
        assert (rounds.accepted == rounds.drafted).all() and (rounds.drafted < 6).any()
    if policy != "static":
        assert rounds.drafted.nunique() > 1
    assert result.extra["draft_forwards"] >= rounds.drafted.sum()


def test_trace_replays_recorded_features_and_verdicts() -> None:
    from sim.oracle.trace import RequestTrace, TraceSequence

    def feats(chosen: float) -> list[float]:
        return [chosen] + [0.0] * (FEATURES - 3) + [1.0, chosen]

    # two recorded rounds at γ=4: 2 accepted (3rd rejected, 4th drafted after it), then 4 accepted
    trace = RequestTrace([(4, 2), (4, 4)], 4, [[feats(0.9), feats(0.9), feats(0.2), feats(0.8)],
                                               [feats(0.9), feats(0.3), feats(0.9), feats(0.9)]])
    import random

    seq = TraceSequence(trace, random.Random(0))
    oracle = make_lookahead("oracle", 4)
    out = seq.chain_round(4, oracle)  # stream positions 0,1 match, 2 rejected: drafts 2, drops 1
    assert (out.accepted, out.proposed, out.dropped) == (2, 2, 1)
    conf = make_lookahead("confidence", 4, threshold=0.5)
    out = seq.chain_round(4, conf)  # from position 3 (round 2): 0.9 then 0.3 < 0.5: stop after 2
    assert (out.accepted, out.proposed) == (2, 2)
    assert make_lookahead("confidence", 4).after_token(features=feats(0.3), position=1) is Decision.STOP


# ------------------------------------------------------------------------------ errors
def test_missing_or_mismatched_classifier_and_bad_options_fail_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="real.train.disco") as e:
        compose_exp("lookahead=disco", f"lookahead.path={tmp_path}/none.json", "acceptance=synthetic")
    assert e.value.key == "lookahead.path"
    bad = tmp_path / "bad.json"
    d = json.loads(Path(position_classifier(tmp_path / "ok.json")).read_text())
    d["w1"] = d["w1"][0][:5]
    bad.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="real.train.disco") as e:
        compose_exp("lookahead=disco", f"lookahead.path={bad}", "acceptance=synthetic")
    assert e.value.key == "lookahead.path"
    for overrides, key in ((("lookahead.threshold=0.3",), "lookahead.threshold"),
                           (("lookahead=confidence", "lookahead.threshold=1.5", "acceptance=synthetic"), "lookahead.threshold"),
                           (("lookahead=confidence",), "lookahead"),  # acceptance=iid has no distributions
                           (("lookahead=oracle", "schedule=decentralized"), "lookahead"),
                           (("lookahead.path=x.json",), "lookahead.path")):
        with pytest.raises(ConfigError) as e:
            compose_exp(*overrides)
        assert e.value.key == key, overrides
    r = run_cli("lookahead=disco", f"lookahead.path={tmp_path}/none.json", "acceptance=synthetic",
                f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 2 and "lookahead.path" in r.stderr and "real.train.disco" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
    r = run_cli("lookahead.bogus=1", f"hydra.run.dir={tmp_path}/run2")
    assert r.returncode == 2 and "lookahead.bogus" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------- the bundled model
def _bundled_policies() -> list:  # type: ignore[type-arg]
    """(draft, policy) pairs. By default the bundled pair's static window (its `sync`) and the
    shipped DISCO weights; the others are slow (~6 s a run, mostly the run's probe forwards and
    prefill): test_real_every_policy_equals_ar_at_temperature_0 holds every policy, with a model
    draft and the n-gram draft, to `ar` on the tiny model by default, and
    test_sync_equals_ar_on_the_bundled_model the bundled target with the n-gram draft."""
    default = {("smollm2_draft", "static"), ("smollm2_draft", "disco")}
    pairs = [*(("smollm2_draft", p) for p in POLICIES), *(("ngram3", p) for p in ("confidence", "disco", "oracle"))]
    return [pytest.param(d, p, id=f"{d}-{p}", marks=() if (d, p) in default else pytest.mark.slow)
            for d, p in pairs]


@pytest.mark.model
@pytest.mark.parametrize(("draft", "policy"), _bundled_policies())
def test_every_policy_equals_ar_on_the_bundled_model(draft: str, policy: str) -> None:
    """The shipped DISCO weights included (models/disco/); one HumanEval prompt per policy."""
    from real.runtime.engine import run

    common = ("backend=real", f"pair=smollm2_135m+{draft}", "workload.num_prompts=1",
              "workload.max_new_tokens=16", "real.progress=false", "real.ignore_eos=true", "schedule.gamma=4")
    result = run(compose_exp(*common, f"lookahead={policy}"))
    sync = [r["output_ids"] for r in result.recorder.requests]
    assert sync == [r["output_ids"] for r in result.baseline.requests], policy
    rounds = result.recorder.frames()[0]
    if policy == "oracle":
        assert (rounds.accepted == rounds.drafted).all()


def test_report_table1_picks_static_opt_per_backend() -> None:
    import pandas as pd

    from testbed.report.sections_lookahead import lookahead_frame, table1

    rows = []
    for backend, best in (("sim", 3), ("real", 2)):
        for pol, g in [("static", 1), ("static", 2), ("static", 3), ("disco", 3), ("oracle", 8)]:
            tps = 10.0 + (5.0 if (pol, g) == ("static", best) else 0.0) + (7.0 if pol == "disco" else 0.0)
            rows.append({"backend": backend, "schedule": "sync", "pair": "p", "workload": "w", "temperature": 0.0,
                         "lookahead": pol, "gamma": g, "tokens_per_s": tps, "tpot_ms": 1e3 / tps, "speedup": tps / 10,
                         "verifications": 10, "generated_tokens": 20, "draft_forwards": 30})
    frame = lookahead_frame(pd.DataFrame(rows))
    opt = frame[frame.policy == "static-opt"].set_index("backend")["gamma"]
    assert opt["sim"] == 3 and opt["real"] == 2
    wide = table1(frame)
    assert list(wide.policy[:2]) == ["static γ=1", "static γ=2"] and "tpot_ms (sim)" in wide.columns
    assert set(frame.target_fw_per_token) == {0.5} and set(frame.draft_fw_per_token) == {1.5}


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("vocab", [49152, 640 * 4, 1000, 97, 5])
def test_draft_token_features_equal_the_softmax_definitions(vocab: int, path: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # both fast paths (PyTorch: one softmax, blocked top-k; the native two-pass kernel) against
    # the definitions: top-k of softmax(x), -sum p log p, p[token]; masked (-inf) logits and ties
    from testbed.spec import lookahead
    from testbed.spec.lookahead import ENTROPY, TOP_K, draft_token_features

    if path == "native":
        from specbed_kernels import native

        if native._LIB is None:
            pytest.skip("no native kernel library (no compiler, or SPECBED_NATIVE=0)")
        monkeypatch.setattr(lookahead, "NATIVE_MIN_VOCAB", 1)
        calls = []
        real = native.token_features

        def counted(*args: object) -> list[float] | None:
            out = real(*args)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(native, "token_features", counted)
    else:
        monkeypatch.setattr(lookahead, "NATIVE_MIN_VOCAB", 10**9)

    gen = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        x = torch.randn(vocab, generator=gen) * (0.2 + trial)
        if trial % 3 == 0:
            x[torch.randint(vocab, (vocab // 3,), generator=gen)] = float("-inf")
        if trial % 4 == 1:
            x[torch.randint(vocab, (4,), generator=gen)] = x.max() + 1.0  # tied top values
        token = int(torch.randint(vocab, (1,), generator=gen))
        # the definitions in float64: torch's float32 softmax is itself off by ~1e-5 on AVX2 hosts
        logp = torch.log_softmax(x.double(), dim=-1)
        p = logp.exp()
        top = torch.topk(p, min(TOP_K, vocab)).values.tolist()
        want = [*top, *[0.0] * (TOP_K - len(top)), float(-(p * logp).nan_to_num().sum()), float(p[token])]
        got = draft_token_features(x, token)
        assert len(got) == FEATURES
        # float32 sums over the vocabulary: torch's softmax is 1.1e-5 off at 49k on an AVX2 host
        np.testing.assert_allclose(got[:ENTROPY], want[:ENTROPY], rtol=3e-5, atol=1e-7)
        assert got[ENTROPY] == pytest.approx(want[ENTROPY], rel=1e-4, abs=1e-5)
        assert got[CHOSEN] == pytest.approx(want[CHOSEN], rel=3e-5, abs=1e-8)
        chosen = draft_token_features(x, token, chosen_only=True)
        assert chosen[CHOSEN] == pytest.approx(want[CHOSEN], rel=3e-5, abs=1e-8)
    if path == "native":
        assert calls == [True] * 24  # (the kernel answered: no silent fallback to PyTorch)


def test_disco_decision_equals_the_classifiers_confidence_against_the_threshold() -> None:
    # the per-token fast path (standardisation folded into layer 1, a logit compared) decides
    # exactly as DiscoClassifier.confidence(x) < threshold, the definition training tunes
    from testbed.spec.lookahead import (
        TOP_K,
        DiscoLookahead,
        load_classifier,
        resolve_path,
        window_features,
    )

    clf = load_classifier(str(resolve_path("models/disco/smollm2_135m+smollm2_draft.json")))
    gen = np.random.default_rng(3)
    stops = 0
    for threshold in (0.2, 0.5, 0.8):
        policy = DiscoLookahead(8, classifier=clf, threshold=threshold)
        for _ in range(200):
            top = np.sort(gen.dirichlet(np.full(TOP_K, 0.3)) * gen.uniform(0.2, 1.0))[::-1]
            feats = [*top, gen.uniform(0, 6), top[0]]
            position = int(gen.integers(1, 9))
            conf = float(clf.confidence(window_features([feats] * position)[-1:])[0])
            got = policy.after_token(features=feats, position=position)
            assert got is (Decision.STOP if conf < threshold else Decision.CONTINUE), (conf, threshold)
            stops += got is Decision.STOP
    assert 0 < stops < 600  # both decisions were taken
