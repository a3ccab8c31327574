"""The one-way delay of a message on a link, and the wire sizes of the messages schedules send.

Both backends use this module, so ``network=`` means the same thing on both and the same seed
gives the same delays: ``sim/runtime/links.py`` draws its jitter from ``LinkDelays`` inside a SimPy
resource, ``real/runtime/links.py`` releases each message at the time ``LinkDelays.deliver`` returns.

Model (one direction of a full-duplex link). A message of ``nbytes`` bytes first *serialises*
onto the wire for ``nbytes / bandwidth`` (one message at a time, first in first out), then
*propagates* for ``latency + jitter`` without holding the wire, so its one-way time is

    latency + nbytes / bandwidth + jitter      (+ queueing behind earlier messages)

``bandwidth = inf`` (config value 0) makes serialisation free. Jitter is exponential with mean
``jitter_s`` (memoryless, a light model of router queues), drawn once per message, in send
order, from ``random.Random(f"{seed}:{link name}")``: reproducible, and adding a link does not
change the draws of the others.

Sizes. ``nbytes`` is the payload (tensor bytes) of a message. The fixed header that
``real/runtime/links.py`` also puts on the wire (``HEADER_BYTES``) is framing, like TCP/IP headers, and
is left out of the model on both backends (it is < 2 µs at 1 Gb/s); ``wire_bytes`` counts it for
accounting. The payload layouts below are what the real schedules send and the simulator
charges: token ids are int32, a tree node is (token, position, parent) in int32, activations
are ``tokens x hidden`` in the activation dtype, draft distributions ``k x vocab``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, NamedTuple

TOKEN_BYTES = 4  # a token id on the wire (int32)
TREE_NODE_BYTES = 3 * TOKEN_BYTES  # token id, position, parent index (int32 each): the mask is implied
HEADER_INTS = 30  # int64 fields of real/runtime/links.py's fixed header (see real/runtime/links.py)
HEADER_BYTES = 8 * HEADER_INTS


def bandwidth_Bps(gbps: float) -> float:
    """Config GB/s -> bytes/s; 0 means unlimited."""
    return gbps * 1e9 if gbps > 0 else math.inf


@dataclass(frozen=True)
class LinkModel:
    """The parameters of one direction of a link (times in seconds, bandwidth in bytes/s)."""

    name: str
    latency_s: float
    bandwidth_Bps: float = math.inf
    jitter_s: float = 0.0  # mean of the exponential jitter

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.jitter_s < 0 or not self.bandwidth_Bps > 0:
            raise ValueError(f"link {self.name}: latency {self.latency_s}, jitter {self.jitter_s} "
                             f"must be >= 0 and bandwidth {self.bandwidth_Bps} > 0 (inf for unlimited)")

    def __str__(self) -> str:
        bw = "inf" if math.isinf(self.bandwidth_Bps) else f"{self.bandwidth_Bps / 1e9:g} GB/s"
        return (f"{self.name}: {self.latency_s * 1e3:g} ms, {bw}, "
                f"jitter exp(mean {self.jitter_s * 1e3:g} ms)")

    def serialization_s(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_Bps

    def transfer_s(self, nbytes: float) -> float:
        """Expected one-way time of an unqueued message, without jitter."""
        return self.latency_s + nbytes / self.bandwidth_Bps

    def mean_s(self, nbytes: float) -> float:
        """Mean one-way time of an unqueued message, jitter included."""
        return self.transfer_s(nbytes) + self.jitter_s

    def quantile_s(self, nbytes: float, q: float) -> float:
        """The q-quantile of an unqueued message's one-way time (exponential jitter)."""
        jit = -self.jitter_s * math.log1p(-q) if self.jitter_s > 0 else 0.0
        return self.transfer_s(nbytes) + jit


class Delivery(NamedTuple):
    start_s: float  # serialisation starts (after the messages ahead of it)
    on_wire_s: float  # serialisation ends: the wire is free for the next message
    arrival_s: float  # the message is at the receiver


class LinkDelays:
    """The seeded per-message draws of one link, plus its FIFO wire clock (for ``deliver``)."""

    __slots__ = ("model", "rng", "wire_free_s")

    def __init__(self, model: LinkModel, seed: int) -> None:
        self.model = model
        # str seeds are hashed with SHA-512 by random.Random: stable across processes
        self.rng = random.Random(f"{seed}:{model.name}")
        self.wire_free_s = -math.inf

    def jitter(self) -> float:
        """The next message's jitter (consumes one draw when jitter is on)."""
        j = self.model.jitter_s
        return self.rng.expovariate(1.0 / j) if j > 0 else 0.0

    def propagation(self) -> float:
        """latency + jitter of the next message (one draw)."""
        return self.model.latency_s + (self.jitter() if self.model.jitter_s > 0 else 0.0)

    def deliver(self, send_s: float, nbytes: float) -> Delivery:
        """When a message handed to the link at ``send_s`` arrives: it waits for the wire,
        serialises, then propagates. Call in send order (the draws are in that order)."""
        start = max(send_s, self.wire_free_s)
        on_wire = start + nbytes / self.model.bandwidth_Bps
        self.wire_free_s = on_wire
        return Delivery(start, on_wire, on_wire + self.propagation())


# ------------------------------------------------------------------------- message sizes
def tokens_bytes(n: int) -> int:
    """n token ids (verified tokens, a DSD return message)."""
    return n * TOKEN_BYTES


def features_bytes(n: int, *, hidden: int, act_bytes: int) -> int:
    """The target's last hidden states of n verified tokens: what a feature-level (eagle) draft
    reads, sent with the verified tokens when the draft runs elsewhere."""
    return n * hidden * act_bytes


def dists_bytes(k: int, vocab: int, dtype_bytes: int = 4) -> int:
    """k draft distributions over the vocabulary (needed for lossless sampling at T > 0)."""
    return k * vocab * dtype_bytes


TREE_TIMES_BYTES = 16  # two float64: the draft's seconds since the last subtree, its prefill end


def subtree_message_bytes(batch: Any, *, vocab: int, sampled: bool) -> int:
    """A subtree (testbed.spec.tree.TreeBatch) as the async draft sends it to the target
    (real/runtime/async_messages.pack_batch): a row per node, the two times, and when ``sampled``
    (temperature > 0) the draft's q (fp32 over the ``vocab``) at every node with children in
    the batch — what the target's lossless multi-candidate rule needs. At T = 1 on a 49k
    vocabulary that is ~0.8 MB for a batch of 8, against ~0.1 kB of rows. (The simulator's
    trees may be grown from ranks rather than distributions: the count comes from the tree's
    shape and the experiment, not from the tree's mode.)"""
    inner = sum(1 for kids in batch.children if kids) if sampled else 0
    return len(batch.tokens) * TREE_NODE_BYTES + TREE_TIMES_BYTES + dists_bytes(inner, vocab)


def draft_dists_bytes(k: int, *, vocab: int, topk: int) -> int:
    """k draft distributions as the decentralized window carries them at temperature > 0:
    ``topk`` (fp32 value, int32 index) pairs per guess, or full fp32 rows when ``topk`` is 0
    (real/schedules/decentralized.py says why top-k is still exactly lossless there)."""
    if topk <= 0 or topk >= vocab:
        return dists_bytes(k, vocab)
    return k * topk * (4 + TOKEN_BYTES)


def dsd_window_bytes(tokens: int, *, hidden: int, act_bytes: int, dists: int = 0) -> int:
    """One decentralized window between stages: activations, the window's token ids and the
    draft distributions' bytes ``dists`` (``draft_dists_bytes``, 0 when q is not sent)."""
    return activation_bytes(tokens, hidden, act_bytes) + tokens_bytes(tokens) + dists


PREFILL_END_BYTES = 8  # the last stage's prefill end (float64) in its answer to a prompt


def dsd_verified_bytes(tokens: int, *, hidden: int, act_bytes: int, features: bool) -> int:
    """The last stage's answer to a decentralized window: the ``tokens`` emitted token ids and,
    for a feature-level (eagle) draft (``features``), the target's features of as many
    positions (the window's old root and its accepted guesses: what the draft reads next)."""
    return tokens_bytes(tokens) + (features_bytes(tokens, hidden=hidden, act_bytes=act_bytes)
                                   if features else 0)


def dsd_prompt_answer_bytes(fed: int, *, hidden: int, act_bytes: int, features: bool) -> int:
    """The last stage's answer to a decentralized prompt: its prefill end and, for an eagle
    draft, the target's features of the ``fed`` prompt tokens (all but the last)."""
    return PREFILL_END_BYTES + (features_bytes(fed, hidden=hidden, act_bytes=act_bytes)
                                if features else 0)


def draft_window_bytes(k: int, *, vocab: int = 0, dist_dtype_bytes: int = 4) -> int:
    """A chain of k draft tokens, with their distributions when ``vocab`` > 0."""
    return tokens_bytes(k) + dists_bytes(k, vocab, dist_dtype_bytes)


def activation_bytes(tokens: int, hidden: int, dtype_bytes: int) -> int:
    """Hidden states of ``tokens`` tokens between pipeline stages."""
    return tokens * hidden * dtype_bytes


def wire_bytes(payload_bytes: int) -> int:
    """Bytes actually on the wire: the fixed header plus the payload (not in the delay model)."""
    return HEADER_BYTES + payload_bytes
