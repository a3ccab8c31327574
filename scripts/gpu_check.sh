#!/usr/bin/env bash
# The GPU check (docs/gpu.md): every real schedule on one CUDA device, one summary.
#   scripts/gpu_check.sh                    on the GPU machine (writes $OUT/gpu_check.{json,md})
#   scripts/gpu_check.sh --device cpu --tiny   the dry run (default test suite)
# Packages the GPU image lacks travel as wheels (`make gpu-wheels` builds .gpu-wheels/ here);
# they are installed into a private folder, nothing else on that machine is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
if ! "$PYTHON" -c "import hydra, omegaconf, simpy, gguf" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_check: hydra/omegaconf/simpy/gguf are missing and $WHEELS/ holds no wheels: run 'make gpu-wheels' where pip works and carry $WHEELS/" >&2
        exit 2
    fi
    SITE=${TMPDIR:-/tmp}/specbed-gpu-site
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_check.py "$@"
