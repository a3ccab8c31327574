"""``validate``: every value of an experiment against its allowed range (testbed/config.py holds
the dataclasses); a bad one raises ``ConfigError`` naming the key, the value and what is allowed."""

from __future__ import annotations

from testbed import backends
from testbed.arrivals import ARRIVALS, TraceError, read_trace, under_load
from testbed.config import (
    MLPS,
    MODEL_KINDS,
    PROFILE_DRIFTS,
    QUANTS,
    ConfigError,
    ExperimentConfig,
    ModelConfig,
    real_dtype,
    workload_names,
)
from testbed.schedules import (
    PIPELINE,
    SINGLE,
    TREE,
    TWO_GROUPS,
    names_where,
    schedule_names,
    spec_of,
    unsupported,
)
from testbed.schedules import spec as schedule_spec
from testbed.spec.lookahead import LOOKAHEADS


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, "one of " + ", ".join(allowed))


def _int_range(key: str, value: int, lo: int, hi: int | None = None) -> None:
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(key, value, f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")


def _float_range(key: str, value: float, *, lo: float, hi: float | None = None,
                 lo_open: bool = False, hi_open: bool = False) -> None:
    bad = value < lo or (lo_open and value == lo)
    if hi is not None:
        bad = bad or value > hi or (hi_open and value == hi)
    if bad or value != value:  # NaN
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ConfigError(key, value, f"a number in {lb}{lo}, {hi if hi is not None else '∞'}{rb}")


def _validate_model(prefix: str, m: ModelConfig, backend: str) -> None:
    _choice(f"{prefix}.kind", m.kind, MODEL_KINDS.names())
    _choice(f"{prefix}.quant", m.quant, QUANTS)
    _choice(f"{prefix}.mlp", m.mlp, MLPS)
    if m.kind in ("transformer", "eagle"):
        for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            _int_range(f"{prefix}.{k}", getattr(m, k), 1)
        if m.heads % m.kv_heads:
            raise ConfigError(f"{prefix}.kv_heads", m.kv_heads,
                              f"a divisor of {prefix}.heads={m.heads}")
    if m.kind == "ngram":
        _int_range(f"{prefix}.ngram", m.ngram, 1, 16)
    if m.kind == "eagle":
        _int_range(f"{prefix}.draft_vocab", m.draft_vocab, 0, m.vocab)
    elif m.draft_vocab:  # only an eagle head borrows an LM head it could restrict
        raise ConfigError(f"{prefix}.draft_vocab", m.draft_vocab, f"0: a draft vocabulary is an eagle head's "
                          f"({prefix}.kind={m.kind})")


def _validate_eagle(exp: ExperimentConfig) -> None:
    """An eagle head is one decoder layer of its target's shape that reads the target's features."""
    t, d = exp.pair.target, exp.pair.draft
    def shape(m: ModelConfig) -> dict[str, int]:
        return {"hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "ffn": m.ffn, "vocab": m.vocab,
                "head_dim": m.head_dim or m.hidden // max(m.heads, 1)}

    for k, v in shape(d).items():
        if v != shape(t)[k]:
            raise ConfigError(f"pair.draft.{k}", v, f"the target's {k}={shape(t)[k]} (an eagle head is one "
                              "layer of its target's width; choose the head trained for this target)")
    _int_range("pair.draft.layers", d.layers, 1, 1)
    # every layout takes one: beside the target, in a draft group the target sends its features
    # to (async), on a pipeline's first stage to which the last returns them (decentralized)


def _validate_lookahead(exp: ExperimentConfig) -> None:
    """lookahead=... and its options (testbed/spec/lookahead.py)."""
    from testbed.spec.lookahead import PER_TOKEN, ClassifierError, load_classifier, resolve_path

    la, s = exp.lookahead, exp.schedule
    _choice("lookahead", la.policy, LOOKAHEADS.names())
    if la.threshold is not None:
        if la.policy not in ("confidence", "disco"):
            raise ConfigError("lookahead.threshold", la.threshold,
                              "unset with lookahead=" + la.policy + " (only confidence and disco use a threshold)")
        _float_range("lookahead.threshold", la.threshold, lo=0.0, hi=1.0)
    if la.path is not None and la.policy != "disco":
        raise ConfigError("lookahead.path", la.path, f"unset with lookahead={la.policy} (only disco loads a classifier)")
    if la.by_batch is not None and la.policy != "batch":
        raise ConfigError("lookahead.by_batch", la.by_batch, f"unset with lookahead={la.policy} (only batch reads it)")
    if la.policy == "batch":
        from testbed.spec.lookahead import parse_by_batch

        if not spec_of(exp).chain:
            raise ConfigError("lookahead", la.policy, f"another policy with schedule={s.name}"
                              + (" (tree)" if s.tree else "") + " (γ by batch size: the sync chain's rounds)")
        try:
            parse_by_batch(la.by_batch or "")
        except ValueError as e:
            raise ConfigError("lookahead.by_batch", la.by_batch, f"'B:γ B:γ ...' ({e})") from None
    if la.policy in PER_TOKEN and not spec_of(exp).chain:
        raise ConfigError("lookahead", la.policy, "static or heuristic with schedule=" + s.name
                          + (" (tree)" if s.tree else "") + " (per-token stopping runs in the sync chain)")
    if la.policy in ("confidence", "disco") and exp.backend == "sim" and exp.acceptance.oracle == "iid":
        raise ConfigError("lookahead", la.policy, "static, heuristic or oracle with acceptance=iid (it has "
                          "no draft distributions: use acceptance=synthetic or acceptance=trace)")
    if la.policy == "oracle" and exp.backend == "real" and exp.sampling.temperature != 0:
        raise ConfigError("lookahead", la.policy, "another policy with sampling.temperature>0 on backend=real "
                          "(the oracle knows the target's choices from its greedy continuation)")
    if la.policy == "disco":
        try:
            load_classifier(str(resolve_path(la.path)), exp.pair.target.name if exp.backend == "real" else "")
        except ClassifierError as e:
            raise ConfigError("lookahead.path", la.path, str(e)) from None


def _validate_load(exp: ExperimentConfig) -> None:
    """workload.arrival and its settings, serving.*, and who can serve under load."""
    w, sv = exp.workload, exp.serving
    _choice("workload.arrival", w.arrival, ARRIVALS)
    _int_range("workload.concurrency", w.concurrency, 1, 100_000)
    if w.arrival == "poisson":
        _float_range("workload.rate", w.rate, lo=0.0, lo_open=True)
    if w.arrival == "trace":
        try:
            read_trace(w.trace_path)
        except TraceError as e:
            raise ConfigError("workload.trace_path", w.trace_path, str(e)) from None
    _int_range("serving.max_batch", sv.max_batch, 0)
    _int_range("serving.kv_budget_tokens", sv.kv_budget_tokens, 0)
    _float_range("serving.slo_ttft_ms", sv.slo_ttft_ms, lo=0.0)
    _float_range("serving.slo_tpot_ms", sv.slo_tpot_ms, lo=0.0)
    if not under_load(w):
        return
    spec = spec_of(exp)
    load = f"workload.arrival={w.arrival}" + (f" with workload.concurrency={w.concurrency}" if w.arrival == "closed" else "")
    if not spec.batches:
        batching = [schedule_spec(n) for n in names_where(lambda s: s.batches)]
        serving = " or ".join(f"schedule={b.schedule}" + (" schedule.tree=true" if b.tree_of else "")
                              for b in batching)
        raise ConfigError("schedule", spec.name, f"{serving} under load ({load}): only they serve "
                          "batched rounds so far; or serve one request at a time (workload.concurrency=1)")
    if exp.backend == "real":
        _validate_real_load(exp, spec, load)


REAL_MAX_BATCH = 64  # KV-cache rows a real run allocates at most (real/model/batch.py CacheRows)


def _validate_real_load(exp: ExperimentConfig, spec, load: str) -> None:  # type: ignore[no-untyped-def]
    """What real/runtime/batching.py serves: `ar`, the chain of `sync` (a draft model, early exit,
    an eagle head or prompt lookup) and the serial tree (a draft model or an eagle head), in one
    process or over a TP group (the leader admits; every rank runs the same rounds);
    real/runtime/batching_async.py: `async` with a draft model or an eagle head, one device per
    group; and real/runtime/pipelined.py: `decentralized` (a draft model, an eagle head or prompt lookup) and
    `ar` over a pipeline of two nodes or more."""
    kind = exp.pair.draft.kind
    if spec.layout == PIPELINE and exp.placement.nodes < 2:
        raise ConfigError("placement.nodes", exp.placement.nodes, f"2 or more under load ({load}) with "
                          f"schedule={spec.name} on backend=real: a one-node pipeline serves one request at "
                          "a time (schedule=sync batches the same draft on one node)")
    tree_kinds = ("transformer", "eagle") if spec.layout in (SINGLE, TREE, TWO_GROUPS) else ("transformer",)
    if (spec.tree or exp.schedule.tree) and kind not in tree_kinds:
        raise ConfigError("pair.draft.kind", kind, f"{' or '.join(tree_kinds)} under load ({load}) with "
                          f"{spec.name}'s token trees on backend=real: the batched trees grow on a draft "
                          f"{'model or head' if len(tree_kinds) > 1 else 'model'}'s own KV-cache rows")
    w, cap = exp.workload, exp.serving.max_batch
    in_flight = w.concurrency if w.arrival == "closed" else w.num_prompts if w.arrival == "poisson" \
        else len(read_trace(w.trace_path))
    if min(cap or in_flight, in_flight) > REAL_MAX_BATCH:
        raise ConfigError("serving.max_batch", cap, f"at most {REAL_MAX_BATCH} under load ({load}) on backend=real: "
                          f"up to {in_flight} requests could be in flight, and each holds a KV-cache row of "
                          "the longest request's slots from admission")
    pl = exp.placement
    tp = max(pl.target_gpus, pl.draft_gpus if spec.drafts else 1)
    if tp > 1 and spec.layout not in (SINGLE, TREE):
        raise ConfigError("placement.target_gpus" if pl.target_gpus > 1 else "placement.draft_gpus", tp,
                          f"1 under load ({load}) with {spec.name} on backend=real: tensor parallelism serves the batched rounds of `ar`, the sync "
                          "chain and the serial tree")


def validate(exp: ExperimentConfig) -> ExperimentConfig:
    """Raise ConfigError on the first bad value; otherwise return the config, with a real run's
    ``real.dtype=auto`` resolved for this host (runs record the dtype they used). Resolving asks
    the native kernels (torch, ~2 s to import), so it waits until the values are known good: a
    bad override of a real run is refused as fast as a simulated one's."""
    _choice("backend", exp.backend, backends.names())
    _int_range("seed", exp.seed, 0)
    s = exp.schedule
    _choice("schedule", s.name, schedule_names())
    spec = spec_of(exp)
    _int_range("schedule.gamma", s.gamma, 1, 64)
    _int_range("schedule.tree_width", s.tree_width, 1, 256)
    _int_range("schedule.tree_budget", s.tree_budget, 1, 1024)
    _int_range("schedule.tree_depth", s.tree_depth, 0, 64)
    _float_range("schedule.tau", s.tau, lo=0.0, hi=1.0)
    _float_range("schedule.lambda1", s.lambda1, lo=0.0, lo_open=True)
    _float_range("schedule.lambda2", s.lambda2, lo=0.0, hi=1.0)
    _float_range("schedule.lambda3", s.lambda3, lo=0.0, hi=1.0)
    _validate_lookahead(exp)

    t, d = exp.pair.target, exp.pair.draft
    _validate_model("pair.target", t, exp.backend)
    if t.kind != "transformer":
        raise ConfigError("pair.target.kind", t.kind, "transformer (only drafts may be ngram/early_exit)")
    _validate_model("pair.draft", d, exp.backend)
    # Draft and target must share a tokenizer. Tokenizer tags decide when both models carry one
    # (embedding tables may be padded differently, e.g. Qwen2-72B 152064 vs Qwen2-1.5B 151936).
    if d.kind == "transformer" and d.tokenizer and t.tokenizer:
        if d.tokenizer != t.tokenizer:
            raise ConfigError("pair.draft.tokenizer", d.tokenizer,
                              f"the target's tokenizer {t.tokenizer!r} (draft and target must share a vocabulary)")
    elif d.kind == "transformer" and d.vocab != t.vocab:
        raise ConfigError("pair.draft.vocab", d.vocab,
                          f"the target's vocabulary size {t.vocab} (draft and target must share a tokenizer)")
    if d.kind == "early_exit":
        _int_range("pair.draft.exit_layer", d.exit_layer, 1, t.layers - 1)
    if d.kind == "eagle":
        _validate_eagle(exp)

    hw, pl = exp.hardware, exp.placement
    _int_range("hardware.gpus_per_node", hw.gpus_per_node, 1)
    _int_range("hardware.nodes", hw.nodes, 1)
    n = hw.gpus_per_node
    _int_range("placement.target_gpus", pl.target_gpus, 1, n)
    _int_range("placement.draft_gpus", pl.draft_gpus, 1, n)
    if spec.layout == TWO_GROUPS and pl.target_gpus + pl.draft_gpus > n:
        raise ConfigError("placement.draft_gpus", pl.draft_gpus,
                          f"at most {n - pl.target_gpus}: {s.name} puts draft and target on disjoint GPUs "
                          f"and placement.target_gpus={pl.target_gpus} of {n} are taken")
    if spec.layout == TWO_GROUPS and d.kind == "eagle" and exp.backend == "real" and pl.draft_gpus > 1:
        raise ConfigError("placement.draft_gpus", pl.draft_gpus, f"1 with an eagle draft and schedule={s.name} "
                          "on backend=real (the head, one layer, runs unsharded in the draft group's one process)")
    if spec.layout == TWO_GROUPS and d.kind == "early_exit":
        raise ConfigError("pair.draft.kind", d.kind, f"transformer or ngram with schedule={s.name} "
                          f"(an early-exit draft runs on the target's GPUs, {s.name} needs its own)")
    _int_range("placement.nodes", pl.nodes, 1, 64)
    if "placement.nodes" in spec.reads and pl.nodes > t.layers:
        raise ConfigError("placement.nodes", pl.nodes, f"at most the target's {t.layers} layers")

    net = exp.network
    _float_range("network.latency_ms", net.latency_ms, lo=0.0)
    _float_range("network.bandwidth_gbit_s", net.bandwidth_gbit_s, lo=0.0)
    _float_range("network.jitter_ms", net.jitter_ms, lo=0.0)

    a = exp.acceptance
    _choice("acceptance", a.oracle, backends.option_names("acceptance"))
    _float_range("acceptance.alpha", a.alpha, lo=0.0, hi=1.0, hi_open=True)
    _int_range("acceptance.vocab", a.vocab, 2, 1 << 20)
    _int_range("schedule.draft_topk", s.draft_topk, 0)
    if exp.backend == "sim" and "schedule.adaptive" in spec.reads and s.adaptive and a.oracle == "iid":
        raise ConfigError("schedule.adaptive", s.adaptive, "false with acceptance=iid (DSD adaptive "
                          "verification needs token distributions: use acceptance=synthetic)")

    sm = exp.sim
    _choice("sim.cost_model", sm.cost_model, backends.option_names("sim.cost_model"))
    _float_range("sim.c", sm.c, lo=0.0)
    _float_range("sim.t_target_ms", sm.t_target_ms, lo=0.0, lo_open=True)
    _choice("sim.profile_drift", sm.profile_drift, PROFILE_DRIFTS)
    if sm.profile_drift != "none" and sm.profile_rescale:
        raise ConfigError("sim.profile_drift", sm.profile_drift, "none with sim.profile_rescale=true (both "
                          "set the profile's level: the rescale from the trace runs, the drift from a probe)")
    if sm.profile_drift == "run_probe" and a.oracle != "trace":
        raise ConfigError("sim.profile_drift", sm.profile_drift, "none, forward or probe unless "
                          "acceptance=trace (run_probe reads the measured run's probe from the runs "
                          "of acceptance.trace_path)")
    if sm.profile_drift != "none" and sm.cost_model != "profile":
        raise ConfigError("sim.profile_drift", sm.profile_drift, "none unless sim.cost_model=profile (it "
                          "corrects a measured profile for the machine's drift)")

    w = exp.workload
    _choice("workload", w.name, workload_names())
    _int_range("workload.num_prompts", w.num_prompts, 1, 100_000)
    _int_range("workload.max_new_tokens", w.max_new_tokens, 1, 1_000_000)
    _int_range("workload.prompt_len", w.prompt_len, 1, 10_000_000)
    _choice("workload.split", w.split, ("all", "calibrate", "holdout", "trace", "test"))
    _validate_load(exp)

    sp = exp.sampling
    _float_range("sampling.temperature", sp.temperature, lo=0.0, hi=100.0)
    _int_range("sampling.top_k", sp.top_k, 0)
    _float_range("sampling.top_p", sp.top_p, lo=0.0, hi=1.0, lo_open=True)

    why = unsupported(exp.backend, s.name, s.tree)
    if why:
        raise ConfigError("schedule", s.name + (" (tree)" if s.tree else ""), why)
    if exp.calibrate and exp.backend != "real":
        raise ConfigError("calibrate", exp.calibrate, "false with backend=sim (calibration measures "
                          "this machine: python -m testbed backend=real +calibrate)")
    _choice("real.dtype", exp.real.dtype, ("auto", "fp32", "bf16", "fp16"))
    _int_range("real.threads", exp.real.threads, 0, 1024)
    _int_range("real.repeats", exp.real.repeats, 1, 1000)
    _int_range("sim.prediction_resamples", exp.sim.prediction_resamples, 0, 10000)
    _float_range("real.recv_timeout_s", exp.real.recv_timeout_s, lo=0.0, hi=3600.0, lo_open=True)
    _choice("real.allreduce", exp.real.allreduce, ("shm", "gloo"))
    if exp.backend == "real" and exp.real.dtype == "auto":
        exp.real.dtype = real_dtype(exp)
    return exp
