"""The target side of a real run: prefill, then forwards that return standardized probabilities;
and ``prefill``, the one prompt forward every model of the real backend uses (target, draft,
the reference greedy loop).

Slot convention (the same as sim/schedules): after ``prefill(ids)`` the cache holds ``ids[:-1]``;
every decode or verification forward feeds the last committed token first, so the target's
cache never needs more than a truncate-free overwrite to roll back (gpt-fast's static cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from real.model.decoder import Transformer
from testbed.spec.sampling import SamplingParams, standardize


def sync_device() -> None:
    """Wait for the GPU's queued work (a timer around a forward that returns no logits reads
    the launch, not the work, without it); nothing on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@torch.inference_mode()
def prefill(model: Transformer, tokens: Sequence[int], *, last_logits: bool = False,
            every_logit: bool = False) -> torch.Tensor | None:
    """Reset ``model``'s cache and write ``tokens`` into slots ``0..len-1``. With
    ``last_logits`` return the fp32 logits after the last token ``[V]`` (the LM head runs only
    there), with ``every_logit`` those after every token ``[len, V]`` (a teacher's), else None
    (no LM head: no token is sampled)."""
    model.truncate(0)
    if not tokens:
        return None
    x = torch.tensor([list(tokens)], device=model.device)
    h = model.forward_layers(model.embed(x), 0)
    if every_logit:
        return model.head(h)[0]
    return model.head(h[:, -1:])[0, -1] if last_logits else None


class TargetRunner:
    def __init__(self, model: Transformer, params: SamplingParams) -> None:
        self.model, self.params = model, params

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> None:
        """Cache ``prompt_ids[:-1]`` in slots ``0..n-2`` (no LM head: no token is sampled here)."""
        prefill(self.model, prompt_ids[:-1])

    @torch.inference_mode()
    def probs(self, tokens: list[int], start: int) -> torch.Tensor:
        """Feed ``tokens`` at slots ``start..``; the target's distributions after each, ``[T, V]``."""
        return standardize(chain_logits(self.model, tokens, start), self.params)


def chain_logits(model: Transformer, tokens: list[int], start: int) -> torch.Tensor:
    """fp32 logits ``[T, V]`` (on the host) after feeding ``tokens`` at slots ``start..``: replayed
    from a CUDA graph where the model has them (real.model.cuda_graphs), else the eager forward."""
    # a graph replays logits only: a model whose hidden states a feature-level draft reads runs eagerly
    graphs = None if model.keep_hidden else model.graph_forwards
    logits = graphs.logits(tokens, start) if graphs is not None else None
    if logits is None:
        logits = model(torch.tensor([tokens], device=model.device), input_pos=start)[0]
    return logits
