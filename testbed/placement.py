"""Who runs where: the experiment's placement as groups of ranks, their channels and links.

One description for both backends: ``sim/runtime/topology.py`` turns it into SimPy links between GPU
groups, ``real/runtime/launch.py`` into worker processes (one rank per device) and torch.distributed
process groups (one per channel).

Layouts (``layout(exp)``: the schedule's declared ``ScheduleSpec.layout``, testbed.schedules;
a one-group schedule over ``placement.nodes > 1`` is pipelined, one with ``schedule.tree=true``
laid out as a tree):

- ``single`` — ``ar``/``sync``: one group ``target`` on ``placement.target_gpus`` devices running
  both models, tensor parallel over the group; no links.
- ``tree`` — ``sync`` with ``schedule.tree=true`` (SwiftSpec-base): both models on all devices of
  the placement, one group ``target``, one after the other; no links.
- ``two_groups`` — ``async``: a ``target`` group (``placement.target_gpus``) and a disjoint ``draft`` group
  (``placement.draft_gpus``) on one machine, TP inside each; the *bridge* channel joins their
  leaders and carries ``link draft->target`` and ``link target->draft`` (the machine's NVLink
  figures from ``hardware=``).
- ``pipeline`` — ``decentralized`` (and ``ar`` with ``placement.nodes > 1``): the target as
  ``placement.nodes`` stages ``stage0..stage{N-1}``, one per machine, each on
  ``placement.target_gpus`` devices with a contiguous layer range (``split_layers``); the draft
  runs on stage0's devices. Stage channels join consecutive leaders in a ring
  (``link stage{i}->stage{i+1}`` carries activations, ``link stage{N-1}->stage0`` the verified
  tokens), over the ``network=`` link.

Ranks are numbered group after group in the order of ``Placement.groups``; a group's leader is
its first rank. Only leaders talk across groups. A link between machines is *emulated* on the
real backend (``network=`` latency, bandwidth and jitter applied by ``real/runtime/links.py``); a link
inside one machine is the physical transport there and only modelled by the simulator.

Devices per machine (``device_count``): the simulator's ``hardware.gpus_per_node``; on the real
backend (and ``hardware=local``) the GPUs (``real.device=cuda``) or the cores this process may
run on (``os.sched_getaffinity``): on CPU a device is one core. A placement that does not fit
is a ``ConfigError`` naming the keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from testbed.config import ConfigError, ExperimentConfig
from testbed.links import LinkModel, bandwidth_Bps
from testbed.schedules import PIPELINE, SINGLE, TREE, TWO_GROUPS, schedule_names, spec, spec_of

TP, BRIDGE, STAGE = "tp", "bridge", "stage"


def split_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """[lo, hi) per stage, sizes differing by at most one (larger stages first)."""
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot split {layers} layers into {stages} stages")
    base, extra = divmod(layers, stages)
    out, lo = [], 0
    for i in range(stages):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def stage_name(i: int) -> str:
    return f"stage{i}"


def link_name(u: str, v: str) -> str:
    return f"link {u}->{v}"


@dataclass(frozen=True)
class Group:
    """A model (or a pipeline stage of the target) on ``len(ranks)`` devices of one machine."""

    name: str  # target | draft | stage{i}
    role: str  # the model the group is for: target | draft
    ranks: tuple[int, ...]
    models: tuple[str, ...]  # models whose weights live here, e.g. ("target", "draft")
    machine: int  # logical machine (node); pipeline stage i is on machine i
    layers: tuple[int, int] | None = None  # the target's [lo, hi) for a stage; None = all layers

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def tp(self) -> int:
        """Tensor-parallel degree of the models of this group."""
        return len(self.ranks)


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link between two group leaders."""

    name: str  # "link u->v": the timeline resource of its messages
    src: str  # group names
    dst: str
    model: LinkModel
    emulated: bool  # crosses machines: the real backend applies model's delay


@dataclass(frozen=True)
class Channel:
    """A set of ranks with its own process group: a group's TP all-reduce, the draft<->target
    bridge between leaders, or one pipeline hop between stage leaders."""

    name: str  # tp:{group} | bridge:draft<->target | stage:{u}->{v}
    kind: str  # tp | bridge | stage
    ranks: tuple[int, ...]
    links: tuple[str, ...] = ()  # names of the directed links it carries (none for tp)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    group: str
    role: str
    models: tuple[str, ...]
    layers: tuple[int, int] | None
    machine: int
    index: int  # position in its group (TP rank); 0 = leader

    def describe(self) -> str:
        """e.g. 'rank 2 (target, group stage1, layers 15-30)', for error messages."""
        where = f", group {self.group}" if self.group != self.role else ""
        lay = f", layers {self.layers[0]}-{self.layers[1]}" if self.layers else ""
        return f"rank {self.rank} ({self.role}{where}{lay})"


@dataclass(frozen=True)
class Placement:
    layout: str  # single | tree | two_groups | pipeline
    world_size: int
    devices_per_machine: int
    groups: tuple[Group, ...]
    channels: tuple[Channel, ...]
    links: tuple[LinkSpec, ...]
    ranks: tuple[RankInfo, ...]
    draft_group: str | None  # the group whose devices run the draft (None: no draft model)

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r} in placement ({', '.join(g.name for g in self.groups)})")

    def channel(self, name: str) -> Channel:
        for c in self.channels:
            if c.name == name:
                return c
        raise KeyError(f"no channel {name!r} in placement")

    def link(self, src: str, dst: str) -> LinkSpec:
        for lk in self.links:
            if (lk.src, lk.dst) == (src, dst):
                return lk
        raise KeyError(f"no link {src}->{dst} in placement")

    def rank(self, rank: int) -> RankInfo:
        return self.ranks[rank]

    def group_of(self, rank: int) -> Group:
        return self.group(self.ranks[rank].group)

    def channels_of(self, rank: int) -> tuple[Channel, ...]:
        return tuple(c for c in self.channels if rank in c.ranks)

    def tp_channel(self, group: str) -> Channel | None:
        name = f"{TP}:{group}"
        return next((c for c in self.channels if c.name == name), None)

    def stages(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.layers is not None)


def layout(exp: ExperimentConfig) -> str:
    declared = spec_of(exp).layout
    if declared in (TWO_GROUPS, PIPELINE):
        return declared
    if exp.placement.nodes > 1:
        return PIPELINE
    if exp.schedule.tree:
        return TREE
    return declared


def device_count(exp: ExperimentConfig) -> int:
    """Devices of one machine: modelled GPUs for the simulator, this machine's for real."""
    if exp.backend != "real" and exp.hardware.name != "local":
        return exp.hardware.gpus_per_node
    if exp.real.device.startswith("cuda"):
        import torch

        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0))


def _draft_has_devices(exp: ExperimentConfig) -> bool:
    return spec_of(exp).drafts and exp.pair.draft.kind == "transformer"


def _link(exp: ExperimentConfig, u: str, v: str, same_machine: bool) -> LinkSpec:
    name = link_name(u, v)
    if same_machine:
        hw = exp.hardware
        model = LinkModel(name, hw.nvlink_latency_us * 1e-6, bandwidth_Bps(hw.nvlink_gbps), 0.0)
    else:
        net = exp.network
        model = LinkModel(name, net.latency_ms * 1e-3, bandwidth_Bps(net.bandwidth_gbit_s / 8),
                          net.jitter_ms * 1e-3)
    return LinkSpec(name, u, v, model, emulated=not same_machine)


class PlacementError(ConfigError):
    """A placement that cannot run: the message names the keys and the fix."""

    def __init__(self, keys: str, message: str) -> None:
        self.key, self.value, self.allowed = keys, None, message
        ValueError.__init__(self, message)


def _check_real(exp: ExperimentConfig, kind: str, *, world: int, devices: int, hosts: int) -> None:
    pl = exp.placement
    if exp.real.device.startswith("cuda") and devices == 0:
        raise PlacementError("real.device", f"real.device={exp.real.device}: CUDA is not available on "
                             "this machine (no CUDA device, or a torch built without CUDA); run on "
                             "the CPU with real.device=cpu")
    what = "GPUs" if exp.real.device.startswith("cuda") else "cores (on CPU a device is one core)"
    need = {TWO_GROUPS: f"placement.target_gpus={pl.target_gpus} + placement.draft_gpus={pl.draft_gpus}",
            PIPELINE: f"placement.nodes={pl.nodes} x placement.target_gpus={pl.target_gpus}",
            TREE: f"max(placement.target_gpus={pl.target_gpus}, placement.draft_gpus={pl.draft_gpus})",
            }.get(kind, f"placement.target_gpus={pl.target_gpus}")
    # a pipeline's stages compute one after another (a window visits them in turn), so its
    # one-process stages may share cores or one GPU: N emulated nodes run on one small machine
    shared = kind == PIPELINE and pl.target_gpus == 1
    if world > devices * hosts and not shared:
        have = f"this machine has {devices}" if hosts == 1 else f"{hosts} machines have {devices} each"
        key = {TWO_GROUPS: "placement.draft_gpus", PIPELINE: "placement.nodes"}.get(
            kind, "placement.target_gpus")
        raise PlacementError(key, f"{need} needs {world} devices but {have} {what}: "
                             "lower it")
    if kind != TWO_GROUPS and _draft_has_devices(exp) and pl.draft_gpus != pl.target_gpus:
        two = [n for n in schedule_names() if spec(n).layout == TWO_GROUPS]
        raise PlacementError("placement.draft_gpus",
                             f"placement.draft_gpus={pl.draft_gpus} must equal placement.target_gpus="
                             f"{pl.target_gpus} with schedule={exp.schedule.name} on backend=real: the "
                             "draft runs tensor parallel on the target's devices (set both, or use "
                             f"{' or '.join(f'schedule={n}' for n in two)} for a draft group of its own)")


def make_placement(exp: ExperimentConfig, *, devices: int | None = None, hosts: int = 1) -> Placement:
    """The placement of ``exp``. ``devices``: per machine (default ``device_count(exp)``);
    ``hosts``: machines of a real run (torchrun ``--nnodes``); checked on backend=real only."""
    pl, kind = exp.placement, layout(exp)
    devices = device_count(exp) if devices is None else devices
    with_draft = spec_of(exp).drafts
    both = ("target", "draft") if with_draft else ("target",)
    groups: list[Group] = []
    links: list[LinkSpec] = []
    if kind == TWO_GROUPS:
        t, d = pl.target_gpus, pl.draft_gpus
        groups = [Group("target", "target", tuple(range(t)), ("target",), 0),
                  Group("draft", "draft", tuple(range(t, t + d)), ("draft",), 0)]
        links = [_link(exp, "draft", "target", True), _link(exp, "target", "draft", True)]
        draft_group: str | None = "draft"
    elif kind == PIPELINE:
        k = pl.target_gpus
        spans = split_layers(exp.pair.target.layers, pl.nodes)
        groups = [Group(stage_name(i), "target", tuple(range(i * k, (i + 1) * k)),
                        both if i == 0 else ("target",), i, lay) for i, lay in enumerate(spans)]
        names = [g.name for g in groups]
        if pl.nodes > 1:
            links = [_link(exp, u, v, False) for u, v in zip(names, names[1:] + names[:1])]
        draft_group = names[0] if with_draft else None
    else:
        n = pl.target_gpus if kind == SINGLE else max(pl.target_gpus, pl.draft_gpus)
        groups = [Group("target", "target", tuple(range(n)), both, 0)]
        draft_group = "target" if with_draft else None
    world = sum(len(g.ranks) for g in groups)
    if exp.backend == "real":
        _check_real(exp, kind, world=world, devices=devices, hosts=hosts)
    channels = [Channel(f"{TP}:{g.name}", TP, g.ranks) for g in groups if len(g.ranks) > 1]
    by_name = {g.name: g for g in groups}
    if kind == TWO_GROUPS:
        channels.append(Channel(f"{BRIDGE}:draft<->target", BRIDGE,
                                (by_name["target"].leader, by_name["draft"].leader),
                                tuple(lk.name for lk in links)))
    for lk in links if kind == PIPELINE else ():
        channels.append(Channel(f"{STAGE}:{lk.src}->{lk.dst}", STAGE,
                                (by_name[lk.src].leader, by_name[lk.dst].leader), (lk.name,)))
    ranks = tuple(RankInfo(r, g.name, g.role, g.models, g.layers, g.machine, i)
                  for g in groups for i, r in enumerate(g.ranks))
    return Placement(kind, world, devices, tuple(groups), tuple(channels), tuple(links), ranks,
                     draft_group)


def tp_degrees(exp: ExperimentConfig) -> dict[str, int]:
    """The TP degree of the group that runs each model (the profile cost model's TP tables, and
    the pre-run check of what a sweep needs from the profile)."""
    pl = make_placement(exp)
    target = next(g for g in pl.groups if g.role == "target")
    draft = pl.group(pl.draft_group) if pl.draft_group else target
    return {"target": target.tp, "draft": draft.tp}
