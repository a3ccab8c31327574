"""Typed experiment configuration: the dataclasses the YAML files in ``conf/`` fill, what every
setting means (``doc``, ``setting_doc``) and ``ConfigError``, which names the key, the value, what
is allowed and what the setting means.

testbed/compose.py registers these dataclasses in Hydra's ConfigStore and turns a composed
OmegaConf tree into them once (``to_experiment``), so hot loops never touch OmegaConf;
testbed/config_validate.py checks every value against its allowed range (``validate``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING

from testbed.paths import CONF_DIR
from testbed.registry import Registry

# acceptance oracles and cost models are the simulator's: their names come from its registries
# (testbed.backends.option_names("acceptance"), option_names("sim.cost_model"))
PROFILE_DRIFTS = ("none", "probe", "forward", "run_probe")
# what a model of a pair is (pair.target.kind, pair.draft.kind); the real backend builds a draft
# of each kind from its own registry (real/runtime/loading.py DRAFTS)
MODEL_KINDS: Registry[str] = Registry("model kind")
MODEL_KINDS.register("transformer", "a decoder with weights of its own")
MODEL_KINDS.register("ngram", "prompt lookup: the longest n-gram match proposes its continuation (drafts only)")
MODEL_KINDS.register("early_exit", "the target's first exit_layer layers and its head (drafts only)")
MODEL_KINDS.register("eagle", "a feature-level head: one decoder layer of the target's width that reads "
                     "the target's last hidden state and shares its embedding and LM head (drafts only)")
MLPS = ("swiglu", "gelu")  # gelu: GPTBigCode/StarCoder, 2 matrices instead of 3
QUANTS = ("fp32", "bf16", "fp16", "int8", "int4_awq", "q4_1")


SHORT_ALLOWED = 60  # characters: an `allowed` this short gets the setting's meaning beside it


class ConfigError(ValueError):
    """A bad configuration value: names the key, the value and what is allowed (and, for a
    setting of the schema, what the setting means and its unit: ``setting_doc``)."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        meaning = setting_doc(key)
        # a range or type ("an integer in [1, 64]") says nothing of what the setting is for;
        # a longer explanation already does
        about = f" ({key}: {meaning})" if meaning and len(allowed) <= SHORT_ALLOWED else ""
        super().__init__(f"{key}={value!r} is not allowed: {allowed}{about}")


def doc(default: Any, text: str, unit: str = "") -> Any:
    """A setting's default with what it means and its unit: the one source of ``--help``
    (testbed/app/cli_help.py), the validation messages (ConfigError) and the README's settings
    (``setting_docs`` reads them)."""
    return field(default=default, metadata={"doc": text, "unit": unit})


@dataclass
class ScheduleConfig:
    name: str = doc("sync", "decoding schedule (also chosen as schedule=NAME)")
    gamma: int = doc(4, "draft tokens per round (sync, decentralized); also the lookahead cap", "tokens")
    tree: bool = doc(False, "sync with a token tree: the serial tree baseline (SwiftSpec-base)")
    tree_width: int = doc(8, "w: leaves expanded per draft forward (SwiftSpec)", "nodes")
    tree_budget: int = doc(8, "bs: tree nodes sent to the target per verification (SwiftSpec)", "nodes")
    tree_depth: int = doc(0, "d: draft expansions per round; 0 = from modelled t_target/t_draft", "expansions")
    adaptive: bool = doc(False, "DSD adaptive (relaxed) verification")
    tau: float = doc(0.0, "DSD relaxation of non-key tokens; 0 = exactly lossless")
    lambda1: float = doc(1.5, "DSD key token: H_draft / H_target > lambda1 (entropy ratio)")
    lambda2: float = doc(0.3, "DSD key token: |P_t(y) - P_d(y)| > lambda2 (probability gap)")
    lambda3: float = doc(0.5, "DSD key token: NormMatch(top-k overlap) < lambda3")
    # decentralized at temperature > 0: the draft samples from its top-k so its distributions
    # travel exactly as k (value, index) pairs per guess; 0 = full rows (real/schedules/decentralized.py)
    draft_topk: int = doc(64, "decentralized, temperature > 0: the draft's distribution travels as "
                          "its top k (value, index) pairs; 0 = full rows", "tokens")


@dataclass
class LookaheadConfig:
    policy: str = doc("static", "how many tokens to draft each round (also chosen as lookahead=NAME)")
    threshold: float | None = doc(None, "stop drafting below this score (confidence: draft probability, "
                                  "default 0.4; disco: the classifier file's tuned one)")
    path: str | None = doc(None, "disco: the classifier file (python -m real.train.disco)")
    by_batch: str | None = doc(None, "batch: γ by the requests in a round, 'B:γ B:γ ...' ascending in B; a round of "
                               "b requests drafts the γ of the largest B <= b (γ 0: no speculation), capped "
                               "at schedule.gamma")


@dataclass
class ModelConfig:
    name: str = MISSING
    kind: str = "transformer"  # transformer | ngram | early_exit | eagle
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
    # eagle: the tokens its proposals may take, the rows of the target's LM head it computes
    # (real/train/draft_vocab.py); 0 = the whole vocabulary
    draft_vocab: int = 0

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention and MLP projections, its two norms."""
        hd = self.head_dim or (self.hidden // max(self.heads, 1))
        attn = self.hidden * hd * (self.heads + 2 * self.kv_heads) + self.heads * hd * self.hidden
        mlp = (2 if self.mlp == "gelu" else 3) * self.hidden * self.ffn
        return attn + mlp + 2 * self.hidden

    @property
    def params(self) -> int:
        """Parameter count of a dense Llama-style decoder (embeddings included)."""
        if self.kind not in ("transformer", "eagle"):
            return 0
        if self.kind == "eagle":  # its layer, fc and feature norm; embedding and LM head are the target's
            return self.layers * self.layer_params + 2 * self.hidden * self.hidden + 2 * self.hidden
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + emb + self.hidden

    def stage_share(self, lo: int, hi: int) -> float:
        """The share of a forward's weight reads that a pipeline stage of layers ``[lo, hi)``
        makes: its layers, and on the last stage the LM head (the embedding is a lookup of a few
        rows). A decode forward streams its weights, so a stage takes about this share of its
        time (measured on the bundled target split in two: 41 % and 59 %, this share 39.5 % and
        60.5 %); layers/total for a model without its shapes."""
        if self.kind != "transformer" or not (self.hidden and self.heads and self.vocab and self.layers):
            return (hi - lo) / max(self.layers, 1)
        per_layer, head = self.layer_params, self.vocab * self.hidden
        return ((hi - lo) * per_layer + (head if hi >= self.layers else 0)) / (self.layers * per_layer + head)


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
    target_gpus: int = doc(8, "the target's devices (tensor parallel; per stage with nodes > 1)",
                           "GPUs; cores on hardware=local with real.device=cpu")
    draft_gpus: int = doc(8, "the draft's devices; sync: may share the target's, async: disjoint "
                          "from them", "GPUs; cores on hardware=local with real.device=cpu")
    nodes: int = doc(1, "decentralized: pipeline stages, one node each", "nodes")


@dataclass
class NetworkConfig:
    name: str = doc("nvlink", "the network between nodes (also chosen as network=NAME)")
    latency_ms: float = doc(0.0, "one-way latency of a link between nodes", "ms")
    bandwidth_gbit_s: float = doc(0.0, "bandwidth of a link between nodes; 0 = unlimited",
                                  "Gbit/s (gigabits per second: 1 for a 1 Gb/s link)")
    jitter_ms: float = doc(0.0, "random extra delay per message on a link (exponential, this mean)", "ms")


@dataclass
class AcceptanceConfig:
    oracle: str = doc("iid", "where simulated acceptance comes from (also chosen as acceptance=NAME)")
    alpha: float = doc(0.8, "iid/synthetic: probability that the target accepts a draft token",
                       "probability, 0-1")
    vocab: int = doc(512, "synthetic: vocabulary of the procedural language model", "tokens")
    trace_path: str | None = doc(None, "trace: a real run directory (or its rounds.parquet, or a "
                                 "directory of runs) whose recorded rounds are replayed")


@dataclass
class SimConfig:
    cost_model: str = doc("roofline", "how forward times are modelled: analytic | roofline | profile")
    c: float = doc(0.05, "analytic: draft forward time / target forward time", "ratio")
    t_target_ms: float = doc(25.0, "analytic: one target forward (all stages together)", "ms")
    profile_path: str | None = doc(None, "profile: latency tables written by +calibrate (default: "
                                   "this machine's)")
    profile_rescale: bool = doc(False, "profile + acceptance=trace: scale to the trace runs' round times")
    # profile: the machine's drift, without a run of the configuration: `forward` scales each
    # model's times by its probe forward now / in the profile (real/calibrate/probe_forward.py), `probe`
    # all times by the profile's bandwidth probe / the probe now (testbed/machine.py)
    profile_drift: str = doc("none", "profile: correct for the machine's drift since calibration: "
                             "none | forward | probe | run_probe")
    prediction_resamples: int = doc(0, "acceptance=trace: > 0 adds 95 % prediction intervals "
                                    "(bootstrap resamples)", "resamples")


@dataclass
class WorkloadConfig:
    name: str = doc("synthetic", "prompt set (also chosen as workload=NAME)")
    num_prompts: int = doc(8, "prompts (requests) per run", "prompts")
    max_new_tokens: int = doc(256, "tokens generated per prompt at most", "tokens")
    prompt_len: int = doc(256, "synthetic: prompt length", "tokens")
    split: str = doc("all", "which prompts of the set: all | calibrate | holdout | trace | test")
    chat_template: bool = doc(True, "wrap prompts in the target's chat template (if it has one)")
    # humaneval + backend=real: pass@1 by executing the problems' tests on the generated code in a
    # sandboxed subprocess (testbed/humaneval_exec.py); off by default: it runs untrusted code
    exec_tests: bool = doc(False, "humaneval + backend=real: run the problems' tests on the "
                           "generated code (sandboxed) for pass@1")
    # load (testbed/arrivals.py): today's one request at a time is a closed loop of one client
    arrival: str = doc("closed", "how requests arrive: closed (workload.concurrency clients, each "
                       "sends its next prompt when its last is done) | poisson (workload.rate) | "
                       "trace (workload.trace_path)")
    concurrency: int = doc(1, "arrival=closed: clients, i.e. requests in flight", "requests")
    rate: float = doc(0.0, "arrival=poisson: mean arrival rate", "requests/s")
    trace_path: str = doc("", "arrival=trace: CSV or parquet, one row per request: arrival_s, "
                          "prompt_tokens, output_tokens (sorted by arrival_s)")


@dataclass
class ServingConfig:
    max_batch: int = doc(0, "load: requests served in one batched round at most (the rest wait, "
                         "first come first served); 0 = no limit", "requests")
    kv_budget_tokens: int = doc(0, "load: KV-cache slots for the running requests, each holding "
                                "prompt + max new tokens + γ + 1 from admission; 0 = no limit", "tokens")
    slo_ttft_ms: float = doc(0.0, "load: goodput counts requests whose time to first token is at most "
                             "this; 0 = no bound", "ms")
    slo_tpot_ms: float = doc(0.0, "load: goodput counts requests whose time per output token is at "
                             "most this; 0 = no bound", "ms")


@dataclass
class SamplingConfig:
    temperature: float = doc(0.0, "sampling temperature; 0 = greedy")
    top_k: int = doc(0, "sample among the k most probable tokens; 0 = off", "tokens")
    top_p: float = doc(1.0, "nucleus sampling: the smallest set with this probability; 1 = off",
                       "probability, 0-1")


@dataclass
class RealConfig:
    device: str = doc("cpu", "where the models run: cpu | cuda")
    dtype: str = doc("auto", "weights and activations: auto (bf16 where this host runs it faster: the native CPU kernels or a GPU; else fp32) | fp32 | bf16 | fp16")
    cuda_graphs: bool = doc(True, "cuda: replay decode, draft and verification forwards (up to 16 "
                            "tokens) from CUDA graphs instead of launching each kernel")
    threads: int = doc(0, "torch threads per process; 0 = torch's default", "threads")
    baseline: bool = doc(True, "also run `ar` on the same prompts to report the speedup")
    progress: bool = doc(True, "show a progress bar")
    ignore_eos: bool = doc(False, "always generate workload.max_new_tokens tokens")
    recv_timeout_s: float = doc(20.0, "multi-process runs: a receive or collective waits at most this", "s")
    allreduce: str = doc("shm", "tensor-parallel all-reduce: shm (same host, polled) | gloo")
    allow_concurrent: bool = doc(False, "real jobs of sweeps may run at once on this host")
    repeats: int = doc(1, "> 1: measure the run and its `ar` baseline this often, interleaved "
                       "(confidence intervals)", "repeats")


@dataclass
class ReportConfig:
    per_run: bool = doc(True, "write report.md/html (tables) into every single run directory")
    figures: bool = doc(False, "also draw the figures in a single run's report (seconds of plotting)")


@dataclass
class ExperimentConfig:
    backend: str = doc("sim", "simulate (sim) or execute on this machine (real)")
    seed: int = doc(0, "random seed of the run (sampling, simulated acceptance and timing)")
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    pair: PairConfig = field(default_factory=PairConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    real: RealConfig = field(default_factory=RealConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    calibrate: bool = doc(False, "backend=real: measure this machine's latency tables for "
                          "sim.cost_model=profile (a flag: +calibrate)")


def workload_names() -> list[str]:
    """The values of ``workload=``: the files of conf/workload/."""
    return sorted(p.stem for p in (CONF_DIR / "workload").glob("*.yaml"))


def real_dtype(exp: ExperimentConfig) -> str:
    """The dtype a real run of ``exp`` uses: ``real.dtype``, with ``auto`` resolved for this host
    (``specbed_kernels.preferred_dtype``; ``validate`` resolves it already for backend=real, a sweep's
    base experiment of another backend keeps ``auto``)."""
    if exp.real.dtype != "auto":
        return exp.real.dtype
    from specbed_kernels import preferred_dtype

    return preferred_dtype(exp.real.device)


def as_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (for run metadata)."""
    if is_dataclass(obj):
        return {f.name: as_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {k: as_dict(v) for k, v in obj.items()}
    return obj


@functools.cache
def setting_docs() -> dict[str, str]:
    """Every documented setting (dotted key) -> "meaning [unit]"."""
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            if isinstance(f.default_factory, type) and is_dataclass(f.default_factory):
                walk(f.default_factory, f"{prefix}{f.name}.")
            elif "doc" in f.metadata:
                unit = f.metadata["unit"]
                out[prefix + f.name] = f.metadata["doc"] + (f" [{unit}]" if unit else "")
    walk(ExperimentConfig, "")
    return out


def setting_doc(key: str) -> str:
    """What setting ``key`` means, with its unit ("" for an undocumented or unknown key)."""
    return setting_docs().get(key, "")
