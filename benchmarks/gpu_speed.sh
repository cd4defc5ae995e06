#!/usr/bin/env bash
# Speed as a model sees it, on one GPU, in one device call (from the repository root, .gpu/ carried in):
#
#     bash benchmarks/gpu_speed.sh        # about 4 minutes on an H100; BUDGET=<seconds> (default 240)
#
# FlashInfer's norm kernels are JIT-built on first use (minutes on a fresh machine): build them in
# the same command first (importing flashinfer.norm and calling fused_add_rmsnorm once does it), or
# the first FlashInfer rows pay for the build out of this budget.
# 1. setup: benchmarks/gpu_setup.sh (wheels from .gpu/, FlashInfer's bundle where present);
# 2. the in-place output layout on the GPU: tests/op/test_output_layout.py's `gpu` tests (triton,
#    every format, against the separate layout bit for bit);
# 3. the focus: bench_public_op.py's graph replay, L2 cold then hot, at the 16 MiB cells
#    (T 1024 H 8192 and T 2048 H 4096) and their neighbours (T 1024 H 4096, T 2048 H 8192), none
#    and fp8_per_token with the normed output: arnorm in both output layouts (`separate`: three
#    [T, H] tensors; `in_place`: two, as FlashInfer) beside FlashInfer's fused_add_rmsnorm;
# 4. the rest of the table, the same for T 1, 128 and 8192, until the budget ends (later cells are
#    listed as skipped).
# FlashInfer's norm kernels only (never its all-reduce); without FlashInfer (no bundle, or its
# import fails) arnorm is measured all the same. fp8_per_token has no FlashInfer rival at TP 1.
# $OUT: summary.txt (the GPU, the L2, step times, the T 1024 / 2048 rows of both tables), run.log,
# and the bench reports in focus/ and table/ (public-op-<date>-<gpu>.md and .json).
# A dry run of the script's flow on a CPU (no claims; the bench's --smoke shapes; python3 on PATH
# must have torch and triton, the repository first on PYTHONPATH):
#     PATH=/work/venv/bin:$PATH PYTHONPATH=$PWD:$PWD/backends/arnorm-example GPU_SETUP=/dev/null \
#       BENCH_FLAGS=--smoke BUDGET=900 OUT=/tmp/speed bash benchmarks/gpu_speed.sh
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
BUDGET="${BUDGET:-240}"
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/summary.txt"; }

log "setup"
# shellcheck disable=SC1091
source "${GPU_SETUP:-benchmarks/gpu_setup.sh}"
set +e
set -o pipefail
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 \
  | tee -a "$OUT/summary.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import torch, triton

l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", "?") if torch.cuda.is_available() else "no GPU"
print("torch", torch.__version__, "triton", triton.__version__, "L2 bytes", l2)
try:
    import flashinfer
    import flashinfer.norm  # noqa: F401

    print("flashinfer", getattr(flashinfer, "__version__", "?"))
except Exception as exc:
    print(f"flashinfer absent ({type(exc).__name__}: {str(exc)[:200]}): arnorm alone is measured")
PY

# Rows of the 16 MiB cells (and their neighbours) in a report, each table's heading first.
rows() {
  grep -E "^## CUDA-graph|^Correctness|^Error|^\| (1024|2048) \| (4096|8192) \| (none|fp8_per_token) \| yes \|" \
    "$1"/public-op-*.md \
    | cut -c1-220 | tee -a "$OUT/summary.txt"
}
# bench BUDGET_SECONDS OUT_DIR ARGS...: one bench run within BUDGET_SECONDS, its rows summarized.
bench() {
  local budget=$1 dir=$2
  shift 2
  # shellcheck disable=SC2086  # BENCH_FLAGS: words, split on purpose
  PYTHONUNBUFFERED=1 timeout "$budget" python3 benchmarks/bench_public_op.py --no-eager --no-pdl-off \
    --layouts separate,in_place --l2 cold,hot --normed yes --formats none,fp8_per_token \
    --deadline $((budget - 25)) --out "$dir" "$@" ${BENCH_FLAGS:-} \
    >>"$OUT/run.log" 2>&1
  local rc=$?
  log "bench $(basename "$dir"): rc $rc"
  rows "$dir"
}

if [ "$(left)" -gt 180 ]; then
  log "in-place layout, GPU tests"
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/op/test_output_layout.py 2>&1 \
    | tail -4 | tee -a "$OUT/summary.txt"
fi
if [ "$(left)" -gt 60 ]; then
  log "focus: the 16 MiB cells"
  budget=$(( $(left) > 160 ? 100 : $(left) - 15 ))
  bench "$budget" "$OUT/focus" --hidden 8192,4096 --tokens 1024,2048 --replays 25
fi
if [ "$(left)" -gt 45 ]; then
  log "table"
  bench $(( $(left) - 5 )) "$OUT/table" --hidden 4096,8192 --tokens 1,128,8192 --replays 15
  grep -E "^Skipped" "$OUT/table"/public-op-*.md | head -20 | tee -a "$OUT/summary.txt"
else
  log "table: skipped (budget)"
fi
log "done"
