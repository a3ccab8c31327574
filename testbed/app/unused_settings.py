"""Settings that have no effect on an experiment, and the experiment's identity without them.

``unused_settings(exp)`` maps a key prefix (``schedule.tau``, ``network``, ``real`` …) to the
reason it does nothing for this schedule and backend: what *would* use it. The pre-run check
turns a command-line setting that no job of the command uses into an error naming that use, so
a sweep over such a setting cannot silently give flat results.

``experiment_hash(exp)`` is a digest of the resolved experiment with every unused setting reset
to its default (so a harmless leftover value does not make two identical experiments differ);
a sweep re-run into the same directory skips a job whose stored hash matches.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import fields

from testbed.arrivals import under_load
from testbed.config import (
    AcceptanceConfig,
    ExperimentConfig,
    NetworkConfig,
    RealConfig,
    ReportConfig,
    ScheduleConfig,
    SimConfig,
    as_dict,
)
from testbed.schedules import PIPELINE, names_where, spec, spec_of

HASH_FILE = "experiment_hash"


def uses_links(exp: ExperimentConfig) -> bool:
    """Inter-node links exist: a schedule that reads ``network`` laid out as a pipeline — DSD's,
    or `ar` pipelined over ``placement.nodes > 1`` (both backends)."""
    spec = spec_of(exp)
    return "network" in spec.reads and (spec.layout == PIPELINE or exp.placement.nodes > 1)


def readers(key: str, schedule_only: bool = False) -> str:
    """The schedules that read ``key`` as a user selects them: ``schedule=decentralized``, a tree
    variant as ``schedule.tree=true`` (``schedule_only``: the plain names, each once)."""
    specs = [spec(n) for n in names_where(lambda s: key in s.reads)]
    if schedule_only:
        return ", ".join(dict.fromkeys(s.schedule for s in specs))
    return " or ".join(dict.fromkeys("schedule.tree=true" if s.tree_of else f"schedule={s.name}" for s in specs))


def _pipelines(key: str, others_when: str) -> str:
    """The readers of ``key`` laid out as pipelines, then the others that read it only when
    pipelined: ``schedule=decentralized (or ar with placement.nodes>1)``."""
    specs = [spec(n) for n in names_where(lambda s: key in s.reads)]
    piped = " or ".join(f"schedule={s.name}" for s in specs if s.layout == PIPELINE)
    others = " or ".join(s.name for s in specs if s.layout != PIPELINE)
    return f"{piped} (or {others}{others_when})" if others else piped


def unused_settings(exp: ExperimentConfig) -> dict[str, str]:
    """Key prefix -> what would use it, for every setting without effect on this experiment.
    Which schedule reads what is its declaration's ``reads`` (testbed.schedules)."""
    s, out = exp.schedule, {}
    spec = spec_of(exp)
    if "schedule.adaptive" not in spec.reads:
        out["schedule.adaptive"] = f"{readers('schedule.adaptive')} (DSD adaptive verification)"
    if "schedule.lambda*" not in spec.reads:
        out["schedule.lambda*"] = f"{readers('schedule.lambda*')} schedule.adaptive=true (DSD key tokens)"
    if not ("schedule.tau" in spec.reads and s.adaptive):
        out["schedule.tau"] = (f"schedule.adaptive=true with {readers('schedule.tau')} "
                               "(τ relaxes DSD's adaptive verification)")
    if not (s.tree or "schedule.tree_*" in spec.reads):
        out["schedule.tree_*"] = f"{readers('schedule.tree_*')} (token trees)"
    if "schedule.gamma" not in spec.reads:
        out["schedule.gamma"] = (f"a speculative schedule ({readers('schedule.gamma', True)})"
                                 + (f": {s.name} drafts nothing" if not spec.drafts else ""))
    if not spec.drafts:  # a drafting schedule takes the policy setting (a tree keeps its own shape)
        out["lookahead"] = f"a speculative schedule ({readers('lookahead', True)})"
    if "placement.nodes" not in spec.reads:
        out["placement.nodes"] = f"{_pipelines('placement.nodes', '')}: a pipeline over nodes"
    if "schedule.draft_topk" not in spec.reads:
        out["schedule.draft_topk"] = f"{readers('schedule.draft_topk')} (draft distributions on the wire)"
    if not uses_links(exp):
        out["network"] = f"links between nodes: {_pipelines('network', ' with placement.nodes>1')}"
    if exp.backend == "real" and not exp.real.device.startswith("cuda"):
        out["real.cuda_graphs"] = "real.device=cuda"
    if exp.backend == "real" and exp.real.device.startswith("cuda"):
        out["real.allreduce"] = "real.device=cpu (on GPUs tensor parallelism sums with NCCL)"
    if exp.backend != "real":
        out["real"] = "backend=real"
    elif exp.calibrate:  # +calibrate writes its profile to sim.profile_path (if set)
        out.update({f"sim.{f.name}": "backend=sim" for f in fields(SimConfig) if f.name != "profile_path"})
        out["acceptance"] = "backend=sim (the real backend's acceptance comes from its models)"
    else:
        out["sim"] = "backend=sim"
        out["acceptance"] = "backend=sim (the real backend's acceptance comes from its models)"
    if exp.backend == "sim" and exp.sim.cost_model != "analytic":
        out["sim.c"] = "sim.cost_model=analytic"
        out["sim.t_target_ms"] = "sim.cost_model=analytic"
    if exp.backend == "sim" and exp.sim.cost_model != "profile":
        out["sim.profile_*"] = "sim.cost_model=profile"
    if exp.acceptance.oracle != "trace":
        out["acceptance.trace_path"] = "acceptance=trace"
        out["sim.prediction_resamples"] = "acceptance=trace (a bootstrap over the trace's prompts and rounds)"
    if exp.acceptance.oracle != "synthetic":
        out["acceptance.vocab"] = "acceptance=synthetic"
    if exp.acceptance.oracle == "trace":
        out["acceptance.alpha"] = "acceptance=iid or synthetic (trace replays recorded acceptance)"
    if exp.workload.name != "synthetic":
        out["workload.prompt_len"] = "workload=synthetic (real prompt sets have their own lengths)"
    if not (exp.workload.name == "humaneval" and exp.backend == "real"):
        out["workload.exec_tests"] = ("workload=humaneval with backend=real (executes the generated "
                                      "code; the simulator generates none)")
    w = exp.workload
    if w.arrival != "closed":
        out["workload.concurrency"] = "workload.arrival=closed (the clients of a closed loop)"
    if w.arrival != "poisson":
        out["workload.rate"] = "workload.arrival=poisson"
    if w.arrival != "trace":
        out["workload.trace_path"] = "workload.arrival=trace"
    else:  # the trace has a row per request with its output length
        out["workload.num_prompts"] = "workload.arrival=closed or poisson (a trace has a row per request)"
        out["workload.max_new_tokens"] = ("workload.arrival=closed or poisson (a trace gives each "
                                          "request's output_tokens)")
    if not under_load(w):
        out["serving"] = ("load: workload.concurrency > 1, or workload.arrival=poisson or trace "
                          "(one request at a time has no batch, no queue and no SLO)")
    return out


def unused_for(key: str, unused: dict[str, str]) -> str | None:
    """What would use `key` (a dotted override key or a group name), None if it is used.
    An entry names a key and everything below it; a trailing `*` makes it a plain prefix."""
    for entry, why in unused.items():
        if entry.endswith("*"):
            if key.startswith(entry[:-1]):
                return why
        elif key == entry or key.startswith(entry + "."):
            return why
    return None


def normalized(exp: ExperimentConfig) -> ExperimentConfig:
    """The experiment with every unused setting at its default (what the hash covers)."""
    e = copy.deepcopy(exp)
    unused = unused_settings(e)
    sd = ScheduleConfig()
    for f in ("adaptive", "tau", "lambda1", "lambda2", "lambda3", "tree_width", "tree_budget",
              "tree_depth", "gamma"):
        if unused_for(f"schedule.{f}", unused):
            setattr(e.schedule, f, getattr(sd, f))
    if "workload.exec_tests" in unused:
        e.workload.exec_tests = False
    if "placement.nodes" in unused:
        e.placement.nodes = 1
    if "network" in unused:
        e.network = NetworkConfig()
    if "real" in unused:
        e.real = RealConfig()
    if "sim" in unused:
        e.sim = SimConfig()
        e.acceptance = AcceptanceConfig()
    e.report = ReportConfig()  # how results are shown is not part of the experiment
    return e


def experiment_hash(exp: ExperimentConfig) -> str:
    d = as_dict(normalized(exp))
    # hashed under its former name and unit (GB/s), so that the runs of sweeps finished before
    # network.bandwidth_gbit_s was renamed still count as done when the sweep is resumed
    d["network"]["bandwidth_gbps"] = d["network"].pop("bandwidth_gbit_s") / 8
    # one request at a time hashes as before the load settings existed (finished sweeps resume)
    if not under_load(exp.workload):
        d.pop("serving")
        for key in ("arrival", "concurrency", "rate", "trace_path"):
            d["workload"].pop(key)
    blob = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
