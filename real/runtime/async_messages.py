"""The messages of `async` on real models (real/schedules/async_tree.py) between the two groups'
leaders, packed and checked here so the workers read as SwiftSpec's Algorithm 1.

- ``Kind.TREE`` draft -> target, one per round (``pack_batch``): int32 rows (token, parent, draw
  index) per batch node, float64 (draft seconds since the last subtree, draft prefill end), and
  at temperature > 0 the draft's q at each batch node with children in the batch.
- ``Kind.ACTIVATIONS`` target -> draft, once per request, only for a feature-level (eagle)
  draft (``prompt_message``): the target's last hidden states of the prompt but its last token
  ``[n - 1, dim]``, from the target's prefill — what ``EagleDraft.start`` reads. The target sends
  them (it computes them in its prefill anyway, as an EAGLE deployment hands them to its head);
  the draft group cannot draft before they arrive, so the request's decoding starts after
  their transfer.
- ``Kind.VERIFIED`` (``Kind.STOP`` for a request's last round) target -> draft
  (``reply_message``): the emitted tokens (int64), and for an eagle draft the target's last
  hidden states of the old root and the accepted tokens ``[len(tokens), dim]`` (what
  ``EagleTreeTokens.verified_features`` takes), in the dtype the target computed them in: their
  bytes are ``testbed.links.features_bytes(len(tokens), hidden=dim, act_bytes=its element
  size)``, the size the simulator adds to the reply (sim/schedules/async_tree.py,
  ``reply_feature_bytes``; its act_bytes is the preset's ``quant``, the real run's is
  ``real.dtype``).

Every message carries the request, the round as ``version`` and the committed sequence length;
a message that does not belong where it arrives raises ``StaleTree``.
"""

from __future__ import annotations

import torch

from real.runtime.links import Kind, Message
from testbed.spec.tree_io import TreeBatch


class StaleTree(RuntimeError):
    """A subtree or verified message that does not belong to the round it arrived in."""


# ------------------------------------------------------------------------------ subtrees
def pack_batch(batch: TreeBatch, draft_s: float, prefill_end: float) -> tuple[torch.Tensor, ...]:
    rows = torch.tensor([[t, p, d] for t, p, d in zip(batch.tokens, batch.parents, batch.draw_index)],
                        dtype=torch.int32)
    times = torch.tensor([draft_s, prefill_end], dtype=torch.float64)
    if batch.mode == "topk":
        return rows, times
    probs = [batch.draft_probs[i] for i, kids in enumerate(batch.children) if kids]
    return rows, times, torch.stack(probs).float() if probs else torch.zeros(0, 1)


def unpack_batch(msg: Message, mode: str) -> tuple[TreeBatch, float, float]:
    """(the batch with node ids = batch indices, draft seconds, draft prefill end)."""
    rows, times = msg.tensors[0].tolist(), msg.tensors[1].tolist()
    tokens, parents, draws = ([r[i] for r in rows] for i in range(3))
    depths, children = [0] * len(rows), [[] for _ in rows]
    for i in range(1, len(rows)):  # parents come before children
        depths[i] = depths[parents[i]] + 1
        children[parents[i]].append(i)
    for kids in children:
        kids.sort(key=lambda c: draws[c])
    probs: list[torch.Tensor | None] = [None] * len(rows)
    if mode == "sample":
        with_kids = [i for i, kids in enumerate(children) if kids]
        for i, q in zip(with_kids, msg.tensors[2]):
            probs[i] = q
    batch = TreeBatch(node_ids=list(range(len(rows))), tokens=tokens, parents=parents, depths=depths,
                      children=children, draw_index=draws, draft_probs=probs, mode=mode,  # type: ignore[arg-type]
                      prefix_len=msg.committed - 1)
    return batch, times[0], times[1]


# ------------------------------------------------------------------- the target's features
def prompt_message(request_id: int, committed: int, features: torch.Tensor) -> Message:
    """The target's features of the prompt but its last token, ``[committed - 1, dim]``."""
    return Message(Kind.ACTIVATIONS, request_id=request_id, committed=committed, tensors=(features,))


def prompt_features(msg: Message, request_id: int, committed: int) -> torch.Tensor:
    """The features of ``prompt_message`` for the request the draft is starting."""
    if msg.kind != Kind.ACTIVATIONS or msg.request_id != request_id or msg.committed != committed:
        raise StaleTree(f"draft expected the target's prompt features of request {request_id} "
                        f"({committed} tokens), got kind {msg.kind} request {msg.request_id} "
                        f"after {msg.committed} tokens")
    return msg.tensors[0]


def reply_message(request_id: int, r: int, *, done: bool, committed: int, tokens: list[int],
                  features: torch.Tensor | None) -> Message:
    """The target's answer to round ``r``'s subtree; ``features``: ``[len(tokens), dim]`` for a
    feature-level draft, else None (tokens only)."""
    tensors = (torch.tensor(tokens, dtype=torch.int64),)
    if features is not None:
        if features.shape[0] != len(tokens):
            raise ValueError(f"features of {features.shape[0]} tokens for {len(tokens)} verified ones")
        tensors += (features.contiguous(),)
    return Message(Kind.STOP if done else Kind.VERIFIED, request_id=request_id, round=r, version=r,
                   committed=committed, tensors=tensors)


def reply_parts(msg: Message) -> tuple[list[int], torch.Tensor | None]:
    """(the verified tokens, the target's features of the old root and the accepted tokens, or
    None when the reply carries none)."""
    return msg.tensors[0].tolist(), msg.tensors[1] if len(msg.tensors) > 1 else None
