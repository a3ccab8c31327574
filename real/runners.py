"""The target side of a real run: prefill, then forwards that return standardized probabilities.

Slot convention (the same as sim/schedules): after ``prefill(ids)`` the cache holds ``ids[:-1]``;
every decode or verification forward feeds the last committed token first, so the target's
cache never needs more than a truncate-free overwrite to roll back (gpt-fast's static cache).
"""

from __future__ import annotations

import torch

from real.model import Transformer
from testbed.spec.sampling import SamplingParams, standardize


class TargetRunner:
    def __init__(self, model: Transformer, params: SamplingParams) -> None:
        self.model, self.params = model, params

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> None:
        """Cache ``prompt_ids[:-1]`` in slots ``0..n-2`` (no LM head: no token is sampled here)."""
        self.model.truncate(0)
        if len(prompt_ids) > 1:
            x = torch.tensor([prompt_ids[:-1]], device=self.model.device)
            self.model.forward_layers(self.model.embed(x), 0)

    @torch.inference_mode()
    def probs(self, tokens: list[int], start: int) -> torch.Tensor:
        """Feed ``tokens`` at slots ``start..``; the target's distributions after each, ``[T, V]``."""
        x = torch.tensor([tokens], device=self.model.device)
        return standardize(self.model(x, input_pos=start)[0], self.params)
