"""The plain autoregressive loop over ``Transformer`` (greedy): used by tests and benchmarks as
the reference output and timing of batch-1 decode. Schedules build their own loops on the same
model calls (prefill = one forward over the prompt, then one forward per token)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from real.model.decoder import Transformer
from real.model.runners import prefill


@torch.inference_mode()
def greedy_generate(model: Transformer, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (stops after an EOS token, which is included)."""
    if len(prompt_ids) + max_new_tokens > model.max_seq:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the KV cache ({model.max_seq} slots)")
    eos = set(eos_token_ids)
    out: list[int] = []
    logits = prefill(model, prompt_ids, last_logits=True)
    assert logits is not None, "greedy_generate needs a non-empty prompt"
    token = logits.argmax().view(1, 1)
    for step in range(max_new_tokens):
        out.append(int(token))
        if out[-1] in eos or step == max_new_tokens - 1:
            break
        token = model(token)[:, -1].argmax(-1, keepdim=True)
    return out


def oracle_reference(model: Transformer, prompt_ids: Sequence[int], new_tokens: int,
                     eos_token_ids: Sequence[int] = ()) -> list[int]:
    """The oracle lookahead's reference at temperature 0: the prompt and the target's greedy
    continuation of up to ``new_tokens`` (as many as the KV cache holds), generated untimed
    before a request is served (one at a time, or every request before serving under load)."""
    ids = list(prompt_ids)
    return ids + greedy_generate(model, ids, min(model.max_seq - len(ids), new_tokens), sorted(eos_token_ids))
