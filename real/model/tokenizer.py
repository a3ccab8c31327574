"""Tokenizer of the real backend: a ``tokenizers.Tokenizer`` built from GGUF metadata or loaded
from a checkpoint's ``tokenizer.json``, plus the model's chat template.

GGUF: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE, as SmolLM2 and Llama 3 use) with the
pre-tokenizer named by ``tokenizer.ggml.pre``; control tokens (token type 3) become special
tokens so ``<|im_start|>`` in a prompt maps to its one id. Chat templates are rendered with
jinja2 in a sandbox the way transformers does (trim_blocks, lstrip_blocks); without a template
the ChatML format is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from real.errors import UnsupportedCheckpoint, WeightsNotFound
from real.model.paths import bundled_gguf_path

# gguf token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4
# A tokenizer built from a .gguf file is kept as tokenizers' JSON under .cache/tokenizers/:
# reading the 49k-token vocabulary and merges through gguf's reader takes ~3 s, loading the JSON
# 0.1 s, and every simulated run of a bundled-pair workload counts its prompts' tokens with it.
# The key is the file's path, size and mtime; bump the version when from_gguf builds otherwise.
_CACHE_VERSION = 1

# Llama 3's split regex (llama.cpp pre-tokenizer "llama-bpe")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")

Message = dict[str, str]


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):  # GPT-2 regex after splitting every digit
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise UnsupportedCheckpoint(f"GGUF pre-tokenizer {pre!r} is not supported (smollm, gpt2, "
                                "llama-bpe); use a checkpoint directory with tokenizer.json")


class Tokenizer:
    """encode/decode, special ids and the chat template of one model."""

    def __init__(self, backend: BackendTokenizer, eos_token_ids: Sequence[int], *,
                 bos_token_id: int | None = None, add_bos: bool = False,
                 chat_template: str | None = None) -> None:
        self.backend = backend
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    # ------------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, source, reader=None) -> Tokenizer:  # noqa: ANN001 - reader: gguf.GGUFReader
        """From a .gguf path (through the JSON cache; on a miss read through ``reader`` when the
        caller has the file open already) or an open ``gguf.GGUFReader``."""
        if not hasattr(source, "fields"):
            if not Path(source).is_file():
                raise WeightsNotFound(str(source), "pass an existing .gguf file")
            cache = _cache_file(Path(source))
            cached = cls._from_cache(cache)
            if cached is not None:
                return cached
            from real.model.paths import open_gguf

            tok = cls.from_gguf(reader if reader is not None else open_gguf(source))
            tok._to_cache(cache)
            return tok
        fields = source.fields

        def get(key: str, default=None):
            return fields[key].contents() if key in fields else default

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedCheckpoint(f"GGUF tokenizer model {kind!r} is not supported (only gpt2 "
                                        "byte-level BPE); use a checkpoint directory with tokenizer.json")
        tokens: list[str] = get("tokenizer.ggml.tokens")
        types: list[int] = get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                         ignore_merges=False, fuse_unk=False)
        backend = BackendTokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, k in zip(tokens, types) if k == _CONTROL])
        backend.add_tokens([AddedToken(t, normalized=False)
                            for t, k in zip(tokens, types) if k == _USER_DEFINED])
        eos = [get("tokenizer.ggml.eos_token_id")] + [get("tokenizer.ggml.eot_token_id")]
        return cls(backend, [e for e in eos if e is not None],
                   bos_token_id=get("tokenizer.ggml.bos_token_id"),
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=get("tokenizer.chat_template"))

    @classmethod
    def _from_cache(cls, cache: Path) -> Tokenizer | None:
        try:
            d = json.loads(cache.read_text())
            return cls(BackendTokenizer.from_str(d["tokenizer"]), d["eos_token_ids"],
                       bos_token_id=d["bos_token_id"], add_bos=d["add_bos"],
                       chat_template=d["chat_template"])
        except Exception:  # noqa: BLE001 — absent or damaged (tokenizers raises its own kind):
            return None  # built again from the .gguf

    def _to_cache(self, cache: Path) -> None:
        d = {"tokenizer": self.backend.to_str(), "eos_token_ids": self.eos_token_ids,
             "bos_token_id": self.bos_token_id, "add_bos": self.add_bos,
             "chat_template": self.chat_template}
        tmp = None
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(d, f)
            os.replace(tmp, cache)  # whole or not at all: parallel workers may write it at once
        except OSError:  # a read-only checkout: no cache, the next load reads the .gguf again
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """From a checkpoint directory: tokenizer.json (+ tokenizer_config.json, config.json,
        generation_config.json, chat_template.jinja when present)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise WeightsNotFound(str(path / "tokenizer.json"),
                                  "the checkpoint directory needs its tokenizer.json")
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))

        def read(name: str) -> dict:
            f = path / name
            return json.loads(f.read_text()) if f.is_file() else {}

        tok_cfg, cfg, gen_cfg = read("tokenizer_config.json"), read("config.json"), read("generation_config.json")

        def token_id(tok) -> int | None:  # tokenizer_config spells tokens as str or {"content": str}
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if tok else None

        eos: list[int] = []
        for src in (cfg.get("eos_token_id"), gen_cfg.get("eos_token_id"), token_id(tok_cfg.get("eos_token"))):
            eos += src if isinstance(src, list) else [src] if src is not None else []
        template = tok_cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        bos = cfg.get("bos_token_id", token_id(tok_cfg.get("bos_token")))
        # tokenizer.json's post-processor already adds BOS where the model wants it
        return cls(backend, eos, bos_token_id=bos, add_bos=False, chat_template=template)

    # --------------------------------------------------------------------------------- use
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=True).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None \
                and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        """Render ``messages`` (``{"role", "content"}`` dicts) with the model's template (ChatML
        when it has none); ``tokenize=True`` returns token ids instead of text."""
        text = render_chat_template(self.chat_template or CHATML, messages, add_generation_prompt,
                                    bos_token=self._token(self.bos_token_id),
                                    eos_token=self._token(self.eos_token_ids[0] if self.eos_token_ids else None))
        return self.encode(text, add_bos=False) if tokenize else text

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def render_chat_template(template: str, messages: Sequence[Message], add_generation_prompt: bool,
                         **special: str) -> str:
    """Render an HF-style Jinja chat template in a sandbox (as transformers does)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=list(messages),
                                            add_generation_prompt=add_generation_prompt, **special)


def _cache_file(gguf: Path) -> Path:
    from testbed.paths import repo_path

    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_VERSION}".encode())
    return repo_path(".cache/tokenizers") / f"{gguf.stem}-{key.hexdigest()[:16]}.json"


@functools.cache
def load_bundled_tokenizer() -> Tokenizer:
    """The bundled SmolLM2 tokenizer (from the GGUF metadata), loaded once per process."""
    return Tokenizer.from_gguf(bundled_gguf_path())
