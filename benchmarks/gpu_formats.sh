#!/usr/bin/env bash
# The per-token-group fp8 formats and mxfp4 on one GPU (one command, at most 6 minutes; results under
# $OUT/). Run from the repo root on the device machine:  bash benchmarks/gpu_formats.sh
#   1. exact:   the public op (triton) bit for bit against `reference`, T in {1, 7, 128, 1024, 8192,
#               32768} x H in {2048, 4096, 8192} for each format's main layout, every other layout at
#               H 4096; rows batch-invariant (Config(batch_invariant=True), batches 1/7/128/1024).
#   2. kernels: triton_symm's tests of the new formats (2 and 4 emulated ranks in one process),
#               compiled on the GPU instead of interpreted.
#   3. speed:   bench_public_op.py graph replay, fp8_per_token beside the new formats: T <= 128 against
#               the same op's fp8_per_token time, T >= 8192 as a fraction of copy bandwidth.
# Never stops at the first failure; the last lines are a summary: step, exit code, seconds.
source benchmarks/gpu_setup.sh
OUT="${OUT:-/tmp/gpu_formats}"
mkdir -p "$OUT"
SUMMARY=()

step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  SUMMARY+=("$(printf '%-10s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - start))")")
  echo "== $name (rc=$rc)"
  grep -v '^exact .* OK$' "$OUT/$name.out" | tail -n 60
  tail -n 5 "$OUT/$name.err"
}

python3 -c "import torch; print(torch.cuda.get_device_name(0), 'torch', torch.__version__)"
step exact 200 python3 benchmarks/gpu_formats.py --out "$OUT"
step kernels 60 python3 -m pytest -q -p no:cacheprovider tests/arnorm_triton/symm/test_symm_group_formats.py
step speed 100 python3 benchmarks/bench_public_op.py --no-eager --no-flashinfer --deadline 100 \
  --hidden 4096,8192 --tokens 1,16,128,8192,32768 \
  --formats fp8_per_token,fp8_per_group,fp8_per_group_ue8m0_packed,mxfp4 --out "$OUT"
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
