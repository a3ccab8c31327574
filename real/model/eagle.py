"""A feature-level draft head (EAGLE-style) that reads the target's own hidden states.

The head proposes the target's next feature (the last layer's output, before the final norm)
from the current one and the next token. Pair position j holds (f_{j-1}, x_j):

    u_j   = fc([embed(x_j), norm(f_{j-1})])      (fc: 2·dim -> dim, with bias)
    f̂_j   = one decoder layer over u_0..u_j       (the target's width and heads; its own KV cache)
    q_j   = softmax(target.head(f̂_j))            (the target's final norm and LM head, frozen;
                                                  with a draft vocabulary, only its rows)

so q_j is the draft's distribution of x_{j+1}. Drafting γ tokens runs the layer on its own
outputs: after the real features f_{..n-2} (the target has processed every committed token but
the last, see real/runners.py) the head predicts f̂_{n-1} from (f_{n-2}, x_{n-1}), samples
x̂_n from it, feeds (f̂_{n-1}, x̂_n), and so on. After a verification the target's features of
the accepted tokens replace the drafted ones (the slots are fed again), so the head never
builds on its own guesses across rounds.

The embedding, final norm and LM head are the target's tensors (shared, never copied or
trained); the checkpoint holds the fc, the feature norm and the one layer (~4.2 M parameters
at SmolLM2-135M's width). Lossless verification is unchanged: the head is a draft like any
other for testbed.spec.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

import specbed_kernels as kernels
from real.errors import RealSetupError
from real.model.batch import CacheRows, Feed, layers_rows
from real.model.decoder import ModelArgs, Transformer
from real.model.drafts import _ForwardDraft
from real.model.runners import TargetRunner
from testbed.spec.sampling import SamplingParams, standardize

CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE = "config.json", "model.safetensors", "draft_vocab.safetensors"
ARCHITECTURE = "specbed-eagle"


def head_args(target: ModelArgs) -> ModelArgs:
    """The head's decoder layer: one layer of the target's shape (vocabulary unused: the
    target's embedding and LM head serve)."""
    return ModelArgs(dim=target.dim, n_layers=1, n_heads=target.n_heads, n_kv_heads=target.n_kv_heads,
                     ffn_dim=target.ffn_dim, vocab_size=1, head_dim=target.head_dim,
                     norm_eps=target.norm_eps, rope_theta=target.rope_theta,
                     rope_scaling=target.rope_scaling, max_seq_len=target.max_seq_len, tie_embeddings=True)


class EagleHead(nn.Module):
    """fc + feature norm + one decoder layer; ``target`` lends its embedding, norm and LM head."""

    def __init__(self, target_args: ModelArgs, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        dim = target_args.dim
        self.args = head_args(target_args)
        self.fc_weight = nn.Parameter(torch.empty(dim, 2 * dim, dtype=dtype, device=device), requires_grad=False)
        self.fc_bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)
        self.feature_norm = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.body = Transformer(self.args, dtype, device)  # layers.0 + RoPE + KV cache
        # the tokens the head may propose (sorted ids; None: every token): its LM head computes
        # only their rows of the target's, as EAGLE-3 and FR-Spec restrict the draft's vocabulary
        self.draft_vocab: Tensor | None = None
        # ((the target LM head's data_ptr, its TP rows), its rows of the draft vocabulary, the ids
        # on its device, their positions among the ids)
        self._vocab_rows: tuple[tuple, Tensor, Tensor, Tensor] | None = None

    def logits(self, target: Transformer, features: Tensor) -> Tensor:
        """The draft's fp32 logits ``[B, T, V]`` of predicted features ``[B, T, dim]``: the
        target's final norm and LM head, over the draft vocabulary's rows only where it has one
        (-inf elsewhere, so those tokens are never proposed and q is 0 there: the verification
        stays exact). A tensor-parallel rank computes the draft vocabulary's rows among its own
        and the ranks sum the draft vocabulary's logits (zeros where another rank holds the row),
        as the full head sums the whole vocabulary's."""
        if self.draft_vocab is None:
            return target.head(features)
        rows, ids, at = self._rows(target)
        normed = kernels.rms_norm(features, target.norm, target.args.norm_eps)
        if rows.shape[0]:
            sub = kernels.linear(normed, rows).float()
        else:  # a rank none of whose rows is in the draft vocabulary
            sub = normed.new_zeros(*normed.shape[:-1], 0, dtype=torch.float32)
        if target.tp_vocab is not None:
            sub = target.tp_allreduce(sub.new_zeros(*sub.shape[:-1], ids.numel()).index_copy_(-1, at, sub))
        out = sub.new_full((*sub.shape[:-1], target.args.vocab_size), float("-inf"))
        out.index_copy_(-1, ids, sub)
        return target._to_host(out)

    def _rows(self, target: Transformer) -> tuple[Tensor, Tensor, Tensor]:
        """(this rank's LM-head rows of the draft vocabulary, one contiguous copy per target: the
        native kernels pack a weight once per tensor; the draft vocabulary on the target's device;
        the positions in it of those rows -- all of them without tensor parallelism)."""
        key = (target.output.data_ptr(), target.tp_vocab)
        if self._vocab_rows is None or self._vocab_rows[0] != key:
            assert self.draft_vocab is not None
            ids = self.draft_vocab.to(target.output.device)
            lo, hi = target.tp_vocab or (0, target.args.vocab_size)
            at = ((ids >= lo) & (ids < hi)).nonzero().flatten()
            rows = target.output.detach().index_select(0, ids[at] - lo).contiguous()
            self._vocab_rows = (key, rows, ids, at)
        return self._vocab_rows[1], self._vocab_rows[2], self._vocab_rows[3]

    def set_draft_vocab(self, ids: Tensor | None, vocab_size: int) -> None:
        """Restrict the proposals to ``ids`` (any order, each once, < ``vocab_size``), or lift it."""
        if ids is None:
            self.draft_vocab, self._vocab_rows = None, None
            return
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"a draft vocabulary needs distinct token ids in [0, {vocab_size})")
        self.draft_vocab, self._vocab_rows = ids.sort().values, None

    def init_random(self, seed: int = 0, std: float = 0.02) -> EagleHead:
        gen = torch.Generator().manual_seed(seed)
        self.body.init_random(seed, std)
        self.fc_weight.data.copy_(torch.randn(self.fc_weight.shape, generator=gen) * std)
        return self

    def state(self) -> dict[str, Tensor]:
        """The trained tensors (the body's placeholder embedding, norm and head excluded)."""
        body = {k: v for k, v in self.body.state_dict().items() if k.startswith("layers.")}
        return {"fc.weight": self.fc_weight, "fc.bias": self.fc_bias, "feature_norm": self.feature_norm,
                **{f"body.{k}": v for k, v in body.items()}}

    def inputs(self, target: Transformer, tokens: Tensor, features: Tensor) -> Tensor:
        """u = fc([embed(tokens), norm(features)]): tokens ``[B, T]``, features ``[B, T, dim]``."""
        e = target.embed(tokens)
        f = kernels.rms_norm(features.to(e.dtype), self.feature_norm, self.args.norm_eps)
        return kernels.linear(torch.cat([e, f], dim=-1), self.fc_weight) + self.fc_bias

    def forward(self, target: Transformer, tokens: Tensor, features: Tensor,
                input_pos: Tensor | int | None = None, *, cache: bool = True) -> Tensor:
        """The predicted features ``[B, T, dim]`` (pre-norm, like the target's). With the cache,
        slot 0 is never attended: pairs start at slot 1 (no feature precedes the first token),
        as training's rows start with their first pair."""
        mask = None
        if cache and isinstance(input_pos, int) and input_pos >= 1:
            cols, rows = torch.arange(input_pos + tokens.shape[1]), torch.arange(input_pos, input_pos + tokens.shape[1])
            mask = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= 1)
        return self.body.forward_layers(self.inputs(target, tokens, features), input_pos, mask, cache=cache)


def save_head(head: EagleHead, out: Path, *, target_name: str, extra: dict | None = None) -> None:
    """``out/config.json`` (architecture, the target it reads) + ``out/model.safetensors``."""
    out.mkdir(parents=True, exist_ok=True)
    a = asdict(head.args)
    config = {"architecture": ARCHITECTURE, "target": target_name, **{k: a[k] for k in (
        "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "norm_eps", "rope_theta")}, **(extra or {})}
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in head.state().items()}
    save_file(tensors, str(out / WEIGHTS_FILE))
    save_draft_vocab(head.draft_vocab, out)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def load_head(path: Path, target: Transformer, *, draft_vocab: int | None = None) -> EagleHead:
    """The head at ``path`` for ``target`` (its dtype and device); one line if it does not fit.
    ``draft_vocab``: None takes the folder's draft vocabulary if it has one; 0 drafts from every
    token; N requires the folder's to hold N tokens (``pair.draft.draft_vocab``, which the
    simulator prices)."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError, SafetensorError) as exc:
        raise RealSetupError(f"pair.draft.path={path}: not a readable eagle head ({exc}); train one with "
                             "python -m real.train.draft kind=eagle") from exc
    t = target.args
    want = {"dim": t.dim, "n_heads": t.n_heads, "n_kv_heads": t.n_kv_heads, "head_dim": t.head_dim,
            "ffn_dim": t.ffn_dim}
    wrong = {k: (config.get(k), v) for k, v in want.items() if config.get(k) != v}
    if config.get("architecture") != ARCHITECTURE or wrong:
        raise RealSetupError(f"pair.draft.path={path} is an eagle head for another target "
                             f"({config.get('target')!r}; differs in {wrong or 'architecture'}): "
                             "train one for this target with python -m real.train.draft kind=eagle")
    head = EagleHead(t, target.dtype, target.device)
    own = head.state()
    for k, v in tensors.items():
        if k not in own or own[k].shape != v.shape:
            raise RealSetupError(f"pair.draft.path={path}: tensor {k} {tuple(v.shape)} does not fit "
                                 "this head; retrain with python -m real.train.draft kind=eagle")
        own[k].data.copy_(v)
    vocab_file = path / VOCAB_FILE
    if draft_vocab and not vocab_file.is_file():
        raise RealSetupError(f"pair.draft.draft_vocab={draft_vocab} but {path} has no {VOCAB_FILE}: make it with "
                             f"python -m real.train.draft_vocab --head {path} --size {draft_vocab}, or set "
                             "pair.draft.draft_vocab=0 to draft from every token")
    if vocab_file.is_file() and draft_vocab != 0:
        try:
            ids = load_file(str(vocab_file))["draft_vocab"]
            head.set_draft_vocab(ids, t.vocab_size)
        except (OSError, KeyError, ValueError, SafetensorError) as exc:
            raise RealSetupError(f"pair.draft.path={path}: {VOCAB_FILE} is not a draft vocabulary of this "
                                 f"target ({exc}); make it again with python -m real.train.draft_vocab, or "
                                 "remove it to draft from every token") from exc
        size = 0 if head.draft_vocab is None else head.draft_vocab.numel()
        if draft_vocab is not None and size != draft_vocab:
            raise RealSetupError(f"pair.draft.draft_vocab={draft_vocab} but {path / VOCAB_FILE} holds {size} "
                                 f"tokens: set pair.draft.draft_vocab={size}, or 0 to draft from every token")
    return head


def save_draft_vocab(ids: Tensor | None, out: Path) -> None:
    """``out/draft_vocab.safetensors``: a draft vocabulary's token ids (int32, sorted); nothing for None."""
    if ids is not None:
        save_file({"draft_vocab": ids.sort().values.to(torch.int32).contiguous()}, str(out / VOCAB_FILE))


class EagleDraft(_ForwardDraft):
    """Chain proposals from an eagle head; the target hands over its features (it keeps the
    hidden states of its last forward: ``Transformer.keep_hidden``)."""

    def __init__(self, head: EagleHead, target: Transformer, params: SamplingParams, name: str) -> None:
        super().__init__(params, target.args.vocab_size)
        self.head, self.target, self.name = head, target, name
        target.keep_hidden = True
        self.features = torch.zeros(0, target.args.dim, dtype=target.dtype, device=target.device)
        self.known = 0  # f_0..f_{known-1} are the target's
        self._last: Tensor | None = None  # the head's last predicted feature [dim] ...
        self._last_index = -1  # ... f̂ of this feature index

    def _grow(self, n: int) -> None:
        if self.features.shape[0] < n:
            more = torch.zeros(max(n, 2 * self.features.shape[0]) - self.features.shape[0],
                               self.features.shape[1], dtype=self.features.dtype, device=self.features.device)
            self.features = torch.cat([self.features, more])

    def take_features(self, start: int, features: Tensor) -> None:
        """f_start.. = ``features [count, dim]``, the target's (from its last forward here, or
        sent by the process that ran its last layer: a pipeline's last stage)."""
        count = features.shape[0]
        self._grow(start + count)
        # (features sent by another process arrive on the link's device, in its dtype)
        self.features[start: start + count] = features.to(self.features.device, self.features.dtype)
        self.known = start + count

    def take_target_features(self, start: int, count: int) -> None:
        """f_start..f_{start+count-1} from the target's last forward (its first ``count`` rows)."""
        hidden = self.target.last_hidden
        if hidden is None or hidden.shape[1] < count:
            raise RuntimeError("eagle: the target's last forward kept no hidden states")
        self.take_features(start, hidden[0, :count])

    @torch.inference_mode()
    def forward_probs(self, tokens: list[int], start: int) -> torch.Tensor:
        """One head forward over ``tokens`` at slots ``start..`` for calibration and run probes: its
        cost does not depend on the features' values, so zeros stand in for them."""
        body = self.head.body
        if body.max_seq < start + len(tokens):
            body.setup_cache(start + len(tokens))
        x = torch.tensor([tokens], device=self.target.device)
        feats = torch.zeros(1, len(tokens), self.target.args.dim, dtype=self.target.dtype, device=self.target.device)
        f = self.head(self.target, x, feats, start)
        return standardize(self.head.logits(self.target, f[:, -1:])[0, -1], self.params)

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], *, features: Tensor | None = None) -> None:
        """``features``: the target's of ``prompt_ids[:-1]`` where its last layer ran in another
        process (a pipeline's last stage sends them); None: its last forward here (the prefill)."""
        # the target's prefill fed prompt[:-1]: f_0..f_{n-2}; pair 0 has no feature (slot unused)
        if self.head.body.max_seq != self.target.max_seq:
            self.head.body.setup_cache(self.target.max_seq)
        self.head.body.truncate(0)
        if len(prompt_ids) < 2:
            raise RealSetupError("an eagle draft needs prompts of at least 2 tokens (it reads the "
                                 "target's feature of the token before the last)")
        self._handed(0, len(prompt_ids) - 1, features)
        self.cached, self._last, self._last_index = 1, None, -1

    def commit(self, ids: list[int], accepted: int, proposed: int, *,
               features: Tensor | None = None) -> None:
        """``features``: the target's of the round's old root and accepted guesses where its last
        layer ran in another process; None: its verification forward here."""
        # slots >= the round's base held drafted features: fed again with the target's
        self.cached = min(self.cached, self._base)
        self._handed(self._base - 1, accepted + 1, features)

    def _handed(self, start: int, count: int, features: Tensor | None) -> None:
        if features is None:
            self.take_target_features(start, count)
            return
        if features.shape != (count, self.features.shape[1]):
            raise RuntimeError(f"eagle: expected the target's features of {count} positions, got "
                               f"a tensor of shape {tuple(features.shape)}")
        self.take_features(start, features)

    def pair_features(self, tokens: list[int], start: int) -> Tensor:
        """The features of the pairs that feed ``tokens`` at slots ``start..`` ``[n, dim]``: the
        target's where it has computed them, else (one token) the head's last prediction."""
        n = len(tokens)
        if start - 1 + n <= self.known:  # every pair's feature is the target's
            return self.features[start - 1: start - 1 + n]
        if n == 1 and self._last is not None and start - 1 == self._last_index:
            return self._last[None]
        raise RuntimeError(f"eagle: no feature for pair {start} (target's up to {self.known})")

    def _logits(self, tokens: list[int], start: int) -> torch.Tensor:
        n = len(tokens)
        x = torch.tensor([tokens], device=self.target.device)
        f = self.head(self.target, x, self.pair_features(tokens, start)[None], start)
        self._last, self._last_index = f[0, -1], start + n - 1
        return self.head.logits(self.target, f[:, -1:])[0, -1]


class RowEagleDraft(EagleDraft):
    """An eagle head's state for one of several requests served in batched rounds
    (real/runtime/batching.py): the request's own row of the head's KV cache (``rows``) and its
    own features; the head and the target are shared. Its steps run with the other requests'
    (``eagle_rows_logits``) and compute what the one-request head computes (real/model/batch.py:
    a row computes the same whatever shares the call)."""

    def __init__(self, head: EagleHead, target: Transformer, params: SamplingParams, name: str, *,
                 rows: CacheRows, row: int) -> None:
        super().__init__(head, target, params, name)
        self.rows, self.row = rows, row

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], *, features: Tensor | None = None) -> None:
        """After the target's prefill of ``prompt_ids[:-1]`` (its features are its last forward's)."""
        if len(prompt_ids) < 2:
            raise RealSetupError("an eagle draft needs prompts of at least 2 tokens (it reads the "
                                 "target's feature of the token before the last)")
        self._handed(0, len(prompt_ids) - 1, features)
        self.cached, self._last, self._last_index = 1, None, -1

    def _logits(self, tokens: list[int], start: int) -> torch.Tensor:
        return eagle_rows_logits([(self, tokens, start)])[0]


def eagle_rows_logits(steps: list[tuple[RowEagleDraft, list[int], int]]) -> list[Tensor]:
    """One head forward for several requests' chain steps at once, each ``(draft, tokens, first
    slot)`` on its own row, causal (slot 0 never attended, as ``EagleHead.forward``):
    ``eagle_rows_tree`` with each request's last prediction as its one leaf. The fp32 logits
    ``[V]`` of each; each draft keeps its last predicted feature."""
    parts = []
    for d, toks, s in steps:
        cols, rows = torch.arange(s + len(toks)), torch.arange(s, s + len(toks))
        causal = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= 1)
        parts.append((d.head, d.target, Feed(d.row, toks, s, mask=causal), d.pair_features(toks, s), 1))
    out = eagle_rows_tree(parts)
    for (d, toks, s), (f, _) in zip(steps, out):
        d._last, d._last_index = f[0], s + len(toks) - 1
    return [logits[0] for _, logits in out]


@torch.inference_mode()
def eagle_rows_tree(parts: list[tuple[EagleHead, Transformer, Feed, Tensor, int]]) -> list[tuple[Tensor, Tensor]]:
    """One head forward for the tree expansions of several requests, each ``(head, target, feed
    on its own row with its tree mask, the pairs' features [T, dim], leaves)``: the fc over
    every pair, the head's layer over the rows of all (attention per row under its mask), the LM
    head over every request's leaves at once. Per part: (the head's features f̂ of its last
    ``leaves`` rows ``[leaves, dim]``, their fp32 logits ``[leaves, V]``)."""
    head, target = parts[0][0], parts[0][1]
    dev = target.device
    tokens = torch.tensor([[t for _, _, f, _, _ in parts for t in f.tokens]], device=dev)
    feats = torch.cat([x for _, _, _, x, _ in parts])[None]
    h = layers_rows(head.body, head.inputs(target, tokens, feats), [f for _, _, f, _, _ in parts], lo=0, hi=1)[0]
    ends = torch.tensor([len(f.tokens) for _, _, f, _, _ in parts]).cumsum(0).tolist()
    leaves = [h[end - n: end] for (_, _, _, _, n), end in zip(parts, ends)]
    logits = head.logits(target, torch.cat(leaves)[None])[0]
    return list(zip(leaves, logits.split([n for *_, n in parts])))


# ------------------------------------------------------------------------------ evaluation
def is_eagle_dir(path: Path) -> bool:
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("architecture") == ARCHITECTURE
    except (OSError, ValueError):
        return False


@torch.inference_mode()
def forced_logits(head: EagleHead, target: Transformer, tokens: list[int], start: int) -> Tensor:
    """The head's logits predicting ``tokens[start:]`` (start >= 2), each from the target's
    true feature of the token before (one step from real features: what the first guess of a
    round sees; later guesses read the head's own features, see ``chain_accepted``)."""
    target.setup_cache(len(tokens), 1)
    x = torch.tensor([tokens])
    feats = target.forward_layers(target.embed(x), 0)
    pred = head(target, x[:, 1:], feats[:, :-1], cache=False)  # f̂_1 .. f̂_{L-1}
    return head.logits(target, pred[:, start - 2: len(tokens) - 2])[0]


@torch.inference_mode()
def chain_accepted(head: EagleHead, target: Transformer, tokens: list[int], *, n_prompt: int,
                   gamma: int) -> list[int]:
    """Accepted guesses per T0 sync round when the head drafts γ tokens on its own features and
    the target's continuation is ``tokens[n_prompt:]`` (its greedy output): a round at i proposes
    γ guesses after tokens[:i], keeps the run that equals tokens[i:], and the next starts after
    the correction. Only rounds with a full window of γ positions are counted."""
    params = SamplingParams()
    target.setup_cache(len(tokens) + gamma + 2, 1)
    runner = TargetRunner(target, params)
    draft = EagleDraft(head, target, params, "eagle")
    out, i = [], n_prompt
    try:
        runner.prefill(tokens[:i])
        draft.start(tokens[:i])
        while i + gamma <= len(tokens):
            guesses, _ = draft.propose(tokens[:i], gamma, None)
            n = next((j for j, g in enumerate(guesses) if g != tokens[i + j]), len(guesses))
            out.append(n)
            runner.probs([tokens[i - 1], *guesses], i - 1)  # the verification (its features)
            i += n + 1
            if i <= len(tokens):
                draft.commit(tokens[:i], n, len(guesses))
    finally:
        target.keep_hidden = False
    return out
