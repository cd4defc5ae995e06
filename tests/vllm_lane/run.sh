#!/usr/bin/env bash
# The vLLM lane: arnorm's vLLM drop-ins against a real vLLM on CPU (docs/integrations.md, "Testing
# against a real vLLM"). Creates (or reuses) a venv with vllm and arnorm, then runs the
# vllm-marked tests (tests/vllm_lane) and writes their log under benchmarks/results/.
#
#   tests/vllm_lane/run.sh                 # venv in .vllm-lane-venv, vllm==0.33.0
#   VLLM_LANE_VENV=/path/to/venv VLLM_VERSION=0.33.0 tests/vllm_lane/run.sh
#
# Installing vLLM takes about 4-8 minutes (a CUDA build of torch; it runs on CPU with
# VLLM_TARGET_DEVICE=cpu); the lane itself about 5-10 minutes on 2 cores (the Triton interpreter
# runs arnorm's fused kernel).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_LANE_VENV:-$ROOT/.vllm-lane-venv}"
VERSION="${VLLM_VERSION:-0.33.0}"
LOG="${VLLM_LANE_LOG:-$ROOT/benchmarks/results/vllm-lane-$(date -u +%Y-%m-%d).log}"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
  "$VENV/bin/pip" install "vllm==$VERSION"
fi
# arnorm itself without its dependencies (vLLM pins torch), then what arnorm and its tests need.
"$VENV/bin/pip" install --no-deps -e "$ROOT"
"$VENV/bin/pip" install pluggy "pydantic>=2.7" "pydantic-settings>=2.3" packaging pytest hypothesis ml_dtypes numpy "triton>=3.2"

export VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1
cd "$ROOT"
{
  echo "# vLLM lane, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  "$VENV/bin/python" -c "import vllm, torch, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
  "$VENV/bin/python" -m pytest -p no:cacheprovider -m vllm -s -rA tests/vllm_lane 2>&1
} | tee "$LOG"
exit "${PIPESTATUS[0]}"
