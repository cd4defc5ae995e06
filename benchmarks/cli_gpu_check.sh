#!/usr/bin/env bash
# The CLI, bench and arnorm.testing on a GPU host: explain/demo/bench with --device cuda, the CLI and
# arnorm.testing tests with CUDA tensors, and the model demo when arnorm/cli/_demo_model.py exists.
# Run from the repo root on the H200: bash benchmarks/cli_gpu_check.sh  (writes under $OUT/; ~5 min)
# Never stops at the first failure; the last lines are a summary: step, exit code, expected code.
source benchmarks/gpu_setup.sh
OUT="${OUT:-/tmp/cli_gpu_check}"
mkdir -p "$OUT"
SUMMARY=()

step() {  # step NAME EXPECTED_RC TIMEOUT_S CMD...
  local name="$1" expected="$2" limit="$3"
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  local verdict="ok"
  [ "$rc" = "$expected" ] || verdict="UNEXPECTED"
  SUMMARY+=("$(printf '%-28s rc=%-3s expected=%-3s %4ss  %s' "$name" "$rc" "$expected" "$((SECONDS - start))" "$verdict")")
  echo "== $name (rc=$rc, expected $expected)"
  tail -n 25 "$OUT/$name.out"
  tail -n 5 "$OUT/$name.err"
}

step doctor 0 120 python3 -m arnorm doctor
step backends 0 120 python3 -m arnorm backends
step explain_cuda 0 180 python3 -m arnorm explain --tp 2 --device cuda
step explain_cuda0_fp8 0 180 python3 -m arnorm explain --tp 2 --device cuda:0 --quant fp8_static
step explain_nvfp4_tp4 0 180 python3 -m arnorm explain --tp 4 --quant nvfp4
step explain_no_such_gpu 2 120 python3 -m arnorm explain --device cuda:99
step demo_cuda_auto 0 300 python3 -m arnorm demo --tp 2 --device cuda --layers 2
step demo_cuda_triton 0 300 python3 -m arnorm demo --tp 2 --device cuda --layers 2 --backend triton
PLOT=()
python3 -c "import matplotlib" 2>/dev/null && PLOT=(--plot "$OUT/bench.png")  # optional on this host
step bench_cuda 0 420 python3 -m arnorm bench --tp 2 --device cuda --hidden 4096 --tokens 1,16,128,1024 \
  --iters 50 --warmup 10 --json "$OUT/bench.json" "${PLOT[@]}"
step pytest_cli_testing 0 480 python3 -m pytest -q -p no:cacheprovider -rfs \
  tests/test_cli.py tests/test_bench.py tests/test_conformance_reference.py tests/testing
if [ -f arnorm/cli/_demo_model.py ]; then
  step demo_model_llama 0 480 python3 -m arnorm demo --model llama --tp 2 --device cuda --max-tokens 8
fi

echo
echo "== summary (outputs under $OUT)"
printf '%s\n' "${SUMMARY[@]}"
