"""Typed experiment configuration, registered in Hydra's ConfigStore, and its validation.

The YAML files in ``conf/`` fill these dataclasses; ``to_experiment`` turns the composed
OmegaConf tree into plain frozen-free dataclasses once, so hot loops never touch OmegaConf.
``validate`` checks every value against its allowed range and raises ``ConfigError`` naming
the key, the value and what is allowed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from testbed.paths import CONF_DIR

ORACLES = ("iid", "synthetic", "trace")
COST_MODELS = ("analytic", "roofline", "profile")
PROFILE_DRIFTS = ("none", "probe", "forward", "run_probe")
WORKLOADS = ("synthetic", "humaneval", "mtbench", "alpaca")
MODEL_KINDS = ("transformer", "ngram", "early_exit")
MLPS = ("swiglu", "gelu")  # gelu: GPTBigCode/StarCoder, 2 matrices instead of 3
QUANTS = ("fp32", "bf16", "fp16", "int8", "int4_awq", "q4_1")


class ConfigError(ValueError):
    """A bad configuration value: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is not allowed: {allowed}")


@dataclass
class ScheduleConfig:
    name: str = "sync"
    gamma: int = 4  # draft tokens per round (sync, decentralized); also the lookahead cap
    tree: bool = False  # sync with a token tree: the serial tree baseline (SwiftSpec-base)
    tree_width: int = 8  # w: leaves expanded per draft forward (SwiftSpec)
    tree_budget: int = 8  # bs: tree nodes sent to the target per verification (SwiftSpec)
    tree_depth: int = 0  # d: draft expansions per round; 0 = from modelled t_target/t_draft
    adaptive: bool = False  # DSD adaptive (relaxed) verification
    tau: float = 0.0  # DSD relaxation of non-key tokens; 0 = exactly lossless
    lambda1: float = 1.5  # DSD key token: H_draft / H_target > lambda1
    lambda2: float = 0.3  # DSD key token: |P_t(y) - P_d(y)| > lambda2
    lambda3: float = 0.5  # DSD key token: NormMatch(top-k overlap) < lambda3
    # decentralized at temperature > 0: the draft samples from its top-k so its distributions
    # travel exactly as k (value, index) pairs per guess; 0 = full rows (real/schedules/decentralized.py)
    draft_topk: int = 64


@dataclass
class LookaheadConfig:
    policy: str = "static"
    threshold: float | None = None  # confidence: 0.4; disco: the classifier file's tuned one
    path: str | None = None  # disco: the classifier file (python -m real.train_disco)


@dataclass
class ModelConfig:
    name: str = MISSING
    kind: str = "transformer"  # transformer | ngram | early_exit
    family: str = "llama"
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0  # 0 = hidden // heads
    ffn: int = 0
    vocab: int = 0
    tied_embeddings: bool = False
    max_context: int = 8192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    quant: str = "bf16"
    path: str | None = None  # real backend: checkpoint dir or .gguf; None = bundled/default
    tokenizer: str | None = None  # tokenizer family name; drafts must share the target's
    exit_layer: int = 0  # early_exit: number of target layers the draft runs
    ngram: int = 3  # ngram: longest n-gram matched in the context (prompt lookup)
    mlp: str = "swiglu"  # swiglu (gate, up, down) | gelu (fc, proj)

    @property
    def params(self) -> int:
        """Parameter count of a dense Llama-style decoder (embeddings included)."""
        if self.kind != "transformer":
            return 0
        hd = self.head_dim or (self.hidden // max(self.heads, 1))
        attn = self.hidden * hd * (self.heads + 2 * self.kv_heads) + self.heads * hd * self.hidden
        mlp = (2 if self.mlp == "gelu" else 3) * self.hidden * self.ffn
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + emb + self.hidden


@dataclass
class PairConfig:
    name: str = ""
    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig = field(default_factory=ModelConfig)


@dataclass
class GpuConfig:
    name: str = MISSING
    hbm_gbps: float = 0.0  # HBM bandwidth, GB/s (datasheet)
    mem_gb: float = 0.0
    tflops: dict[str, float] = field(default_factory=dict)  # dense peak by dtype
    launch_us: float = 4.0  # kernel launch / minimum kernel latency


@dataclass
class HardwareConfig:
    name: str = MISSING
    gpu: GpuConfig = field(default_factory=GpuConfig)
    gpus_per_node: int = 8
    nodes: int = 1
    nvlink_gbps: float = 0.0  # per-GPU unidirectional NVLink bandwidth, GB/s
    nvlink_latency_us: float = 0.0
    nic_gbps: float = 0.0  # per-node network (IB/Ethernet) bandwidth, GB/s
    nic_latency_us: float = 0.0
    allreduce_alpha_us: float = 0.0  # α of the α–β all-reduce model (one-shot, small messages)


@dataclass
class PlacementConfig:
    target_gpus: int = 8
    draft_gpus: int = 8  # sync: may share the target's GPUs; async: disjoint from them
    nodes: int = 1  # decentralized: pipeline stages / nodes


@dataclass
class NetworkConfig:
    name: str = "nvlink"
    latency_ms: float = 0.0
    bandwidth_gbps: float = 0.0  # GB/s; 0 = infinite
    jitter_ms: float = 0.0


@dataclass
class AcceptanceConfig:
    oracle: str = "iid"
    alpha: float = 0.8
    vocab: int = 512  # synthetic oracle vocabulary
    trace_path: str | None = None


@dataclass
class SimConfig:
    cost_model: str = "roofline"
    c: float = 0.05  # analytic: draft forward / target forward
    t_target_ms: float = 25.0  # analytic: one target forward (all stages together)
    profile_path: str | None = None  # profile: latency tables written by +calibrate
    profile_rescale: bool = False  # profile + acceptance=trace: scale to the trace runs' round times
    # profile: the machine's drift, without a run of the configuration: `forward` scales each
    # model's times by its probe forward now / in the profile (real/probe_forward.py), `probe`
    # all times by the profile's bandwidth probe / the probe now (testbed/machine.py)
    profile_drift: str = "none"  # none | forward | probe | run_probe
    prediction_resamples: int = 0  # acceptance=trace: > 0 adds 95% prediction intervals (bootstrap)


@dataclass
class WorkloadConfig:
    name: str = "synthetic"
    num_prompts: int = 8
    max_new_tokens: int = 256
    prompt_len: int = 256  # synthetic only
    split: str = "all"  # all | calibrate | holdout | trace | test (testbed.workloads.SPLITS)
    chat_template: bool = True
    # humaneval + backend=real: pass@1 by executing the problems' tests on the generated code in a
    # sandboxed subprocess (testbed/humaneval_exec.py); off by default: it runs untrusted code
    exec_tests: bool = False


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0


@dataclass
class RealConfig:
    device: str = "cpu"
    dtype: str = "fp32"
    threads: int = 0  # 0 = torch default
    baseline: bool = True  # also run `ar` on the same prompts to report speedup
    progress: bool = True
    ignore_eos: bool = False  # true: always generate workload.max_new_tokens tokens
    recv_timeout_s: float = 20.0  # multi-process runs: a receive or collective waits at most this
    allreduce: str = "shm"  # tensor-parallel all-reduce: shm (same host, polled) | gloo
    allow_concurrent: bool = False  # true: real jobs of sweeps may run at once on this host
    repeats: int = 1  # > 1: measure the run and its `ar` baseline this often, interleaved (CIs)


@dataclass
class ReportConfig:
    per_run: bool = True  # write report.md/html (tables) into every single run directory
    figures: bool = False  # also draw the figures in a single run's report (seconds of plotting)


@dataclass
class ExperimentConfig:
    backend: str = "sim"
    seed: int = 0
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    pair: PairConfig = field(default_factory=PairConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    real: RealConfig = field(default_factory=RealConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    calibrate: bool = False  # backend=real: measure the `profile` latency tables (real/calibrate.py)


def default_gpus(role: str, schedule: str, gpus_per_node: int, hardware: str = "") -> int:
    """Placement defaults: every GPU for both models, except `async`, which needs disjoint
    groups — 3/8 of the node for the draft (SwiftSpec's best Llama-3-70B split is 5+3).
    hardware=local (this machine, simulated or real): one device per group (a device is a core
    on CPU), so a real run stays in one process unless tensor parallelism or an async split is
    asked for, and the simulator predicts the same placement."""
    if hardware == "local":
        return 1
    if schedule != "async" or gpus_per_node < 2:
        return gpus_per_node
    draft = max(1, round(3 * gpus_per_node / 8))
    return draft if role == "draft" else gpus_per_node - draft


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("default_gpus"):
        OmegaConf.register_new_resolver("default_gpus", default_gpus)


def model_presets() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def pairs_named(texts: Iterable[str]) -> set[str]:
    """Every `TARGET+DRAFT` of model presets mentioned in these strings (command-line overrides,
    sweep values): the pair combinations a command may compose."""
    import re

    models = set(model_presets())
    found = set()
    for text in texts:
        for t, d in re.findall(r"([A-Za-z0-9_.-]+)\+([A-Za-z0-9_.-]+)", text):
            if t in models and d in models:
                found.add(f"{t}+{d}")
    return found


def register_configs(pairs: Iterable[str] | None = None) -> None:
    """Register the schema so Hydra type-checks every override against it, and the
    `pair=TARGET+DRAFT` combinations of model presets that have no file in conf/pair/ (files
    take precedence). `pairs=None` registers every combination; the CLI passes the pairs its
    command line and sweep configs name, because Hydra copies the whole ConfigStore on every
    composition (256 pairs made each one take a second)."""

    from hydra.core.config_store import ConfigStore

    register_resolvers()
    cs = ConfigStore.instance()
    if "experiment_schema.yaml" not in cs.repo:
        cs.store(name="experiment_schema", node=ExperimentConfig)
    conf = CONF_DIR
    models = model_presets()
    files = {p.stem for p in (conf / "pair").glob("*.yaml")}
    stored = set(cs.repo.get("pair", {}))
    wanted = [f"{t}+{d}" for t in models for d in models] if pairs is None else sorted(pairs)
    for name in wanted:
        t, _, d = name.partition("+")
        if name not in files and f"{name}.yaml" not in stored:
            cs.store(group="pair", name=name, node={
                "defaults": [{"/model@target": t}, {"/model@draft": d}, "_self_"],
                "name": name})


@functools.cache
def _schema() -> DictConfig:
    """The typed schema, built once (10 ms: half of a job's conversion in a sweep)."""
    return OmegaConf.structured(ExperimentConfig)


def to_experiment(cfg: DictConfig | dict) -> ExperimentConfig:
    """Composed config (OmegaConf) -> plain dataclasses; drops the `hydra` node if present."""
    register_resolvers()
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    merged = OmegaConf.merge(_schema(), cfg)  # (merge copies its first argument)
    exp = OmegaConf.to_object(merged)
    assert isinstance(exp, ExperimentConfig)
    if not exp.pair.name:
        exp.pair.name = f"{exp.pair.target.name}+{exp.pair.draft.name}"
    return exp


def compose_experiment(overrides: Iterable[str] = ()) -> ExperimentConfig:
    """The experiment ``python -m testbed OVERRIDES`` runs, composed and validated: for scripts
    (benchmarks, tests) that build runs without the CLI."""
    from hydra import compose, initialize_config_dir

    overrides = list(overrides)
    register_configs(pairs_named(overrides))  # only the pairs named: composing stays fast
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    exp = validate(to_experiment(cfg))
    if not exp.pair.name or exp.pair.name == "+":
        exp.pair.name = f"{exp.pair.target.name}+{exp.pair.draft.name}"
    return exp


def as_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (for run metadata)."""
    if is_dataclass(obj):
        return {f.name: as_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {k: as_dict(v) for k, v in obj.items()}
    return obj


def validate(exp: ExperimentConfig) -> ExperimentConfig:
    """Check every value of `exp` (testbed/config_validate.py); returns `exp` or raises ConfigError."""
    from testbed.config_validate import validate as check

    return check(exp)
