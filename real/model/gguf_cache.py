"""A GGUF's weights, once dequantized, kept as safetensors under ``.cache/weights/``.

Opening the bundled SmolLM2 GGUF through gguf's reader parses ~150k metadata fields (the 49k-token
vocabulary and its merges) in ~8 s, and dequantizing its Q4_1 blocks takes ~3 s more: two thirds
of a one-prompt `python -m testbed backend=real` (15 s on a 2-core AVX2 host), and of every test
and worker process that loads the target. The cached file holds the same fp32 tensors in the
``Transformer``'s layout and the architecture (in the safetensors metadata); reading it takes
well under a second. The tokenizer has its own cache (real/model/tokenizer.py).

The key is the GGUF's path, size and mtime, as the tokenizer's; bump ``_CACHE_VERSION`` when
``weights.load_gguf`` builds the tensors otherwise. A missing or damaged file is built again; a
read-only checkout works without the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

from torch import Tensor

from real.model.decoder import ModelArgs

_CACHE_VERSION = 1
_TIED = "output"  # the LM head when it is the embedding: stored once, safetensors refuses shared storage


def cache_file(gguf: Path) -> Path:
    from testbed.paths import repo_path

    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_VERSION}".encode())
    return repo_path(".cache/weights") / f"{gguf.stem}-{key.hexdigest()[:16]}.safetensors"


def load(gguf: Path) -> tuple[ModelArgs, dict[str, Tensor]] | None:
    """(architecture, fp32 state dict in the ``Transformer``'s layout) from the cache, or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(cache_file(gguf)), framework="pt") as f:
            args = ModelArgs(**json.loads(f.metadata()["args"]))
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception:  # noqa: BLE001 - absent or damaged (safetensors raises its own kinds): rebuilt
        return None
    if args.tie_embeddings:
        state[_TIED] = state["tok_embeddings.weight"]
    return args, state


def store(gguf: Path, args: ModelArgs, state: dict[str, Tensor]) -> None:
    """Keep ``state`` for the next load of ``gguf`` (whole or not at all)."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in state.items() if not (args.tie_embeddings and k == _TIED)}
    tmp = None
    try:
        path = cache_file(gguf)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        save_file(tensors, tmp, metadata={"args": json.dumps(dataclasses.asdict(args))})
        os.replace(tmp, path)  # parallel workers may write it at once: the last whole file wins
    except OSError:  # a read-only checkout or a full disk: no cache, the next load reads the .gguf
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
