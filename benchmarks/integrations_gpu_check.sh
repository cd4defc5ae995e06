#!/usr/bin/env bash
# arnorm.integrations on a GPU host: the vLLM entry points with CUDA tensors (2 ranks sharing one GPU
# over gloo, auto backend; every quant key; which backend served which token count, ulps and bytes
# against the unfused path), the same entry point captured in a CUDA graph at TP 1 after warmup(),
# `arnorm demo --model llama|gemma3` on the GPU (auto and triton, bf16 and fp32), and the CPU tests of
# tests/integrations against this host's torch.
#
# Two modes:
#   bash benchmarks/integrations_gpu_check.sh --fetch-wheels   # HERE (network): transformers, accelerate
#                                                              # and their pure deps for cp312 -> .gpu/whl-hf
#   bash benchmarks/integrations_gpu_check.sh                  # ON THE H200, from the repo root, with .gpu/
#                                                              # carried (writes under $OUT/; ~5 min)
# Never stops at the first failure; the last lines are a summary: step, exit code, expected code.

if [ "${1:-}" = "--fetch-wheels" ]; then
  set -euo pipefail
  out=.gpu/whl-hf
  mkdir -p "$out"
  # Resolve here, then fetch cp312 manylinux wheels without deps; torch, CUDA, numpy, triton and what
  # gpu_setup.sh already carries (pydantic and its needs) stay out.
  pins=$(python3 - <<'PY'
import json, subprocess, sys, tempfile
report = tempfile.mktemp(suffix=".json")
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
                report, "transformers>=5.24,<6", "accelerate>=1.0"], check=True,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
skip = ("torch", "triton", "numpy", "nvidia", "cuda", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
        "setuptools", "typing", "pydantic", "annotated-types")
for item in json.load(open(report))["install"]:
    m = item["metadata"]
    if not m["name"].lower().startswith(skip):
        print(f'{m["name"]}=={m["version"]}')
PY
)
  for p in $pins; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$out" "$p"
  done
  ls "$out"
  exit 0
fi

source benchmarks/gpu_setup.sh
OUT="${OUT:-/tmp/integrations_gpu_check}"
mkdir -p "$OUT"
SUMMARY=()
# The host may have an older transformers of its own (5.17 was seen): ours goes first on PYTHONPATH.
if ! python3 -c "import sys, transformers, accelerate; sys.exit(tuple(map(int, transformers.__version__.split('.')[:2])) < (5, 24))" 2>/dev/null \
    && ls .gpu/whl-hf/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl-hf/*.whl
fi
export TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1

step() {  # step NAME EXPECTED_RC TIMEOUT_S CMD...
  local name="$1" expected="$2" limit="$3"
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  local verdict="ok"
  [ "$rc" = "$expected" ] || verdict="UNEXPECTED"
  SUMMARY+=("$(printf '%-26s rc=%-3s expected=%-3s %4ss  %s' "$name" "$rc" "$expected" "$((SECONDS - start))" "$verdict")")
  echo "== $name (rc=$rc, expected $expected)"
  tail -n 30 "$OUT/$name.out"
  tail -n 8 "$OUT/$name.err"
}

mkdir -p "$OUT/py"
cat >"$OUT/py/integ_gpu_vllm.py" <<'PY'
"""vLLM entry points on CUDA, 2 ranks on one GPU (gloo), auto backend, against the unfused path."""
import sys

import torch
import torch.distributed as dist

H, EPS = 4096, 1e-6
TOKENS = (1, 16, 128, 1024, 4096)
KEYS = ("fp8_static", "fp8_per_token", "nvfp4", "mxfp8")


class Norm(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(w, requires_grad=False), EPS


def unfused(x, residual, w):
    s = x.clone()
    dist.all_reduce(s)
    h = s + residual
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())).to(x.dtype), h


def rank_main(rank, world):
    from arnorm.integrations import vllm as av
    from arnorm.quant import quantize
    from arnorm.testing import ulp_distance

    dev = torch.device("cuda", torch.cuda.current_device())
    av.configure(group=dist.group.WORLD, max_tokens=2048)
    rows = []
    for t in TOKENS:
        g = torch.Generator().manual_seed(t)
        # Multiples of 1/16: any all-reduce order sums them exactly, so residuals compare bitwise.
        parts = [(torch.randint(-32, 33, (t, H), generator=g) / 16).bfloat16() for _ in range(world)]
        res = torch.randn(t, H, generator=g).bfloat16().to(dev)
        w = (torch.randn(H, generator=g) * 0.2).bfloat16().to(dev)
        x = parts[rank].to(dev)
        want_y, want_h = unfused(x, res, w)
        y, h = av.fused_allreduce_gemma_rms_norm(x.clone(), res, Norm(w))
        backend = av.op_for(H, torch.bfloat16, EPS, device=dev).backend_for(t) if t <= 2048 else "over budget"
        backend = "unfused" if backend in ("reference", "over budget") else backend  # the path it took
        rows.append(f"norm      T={t:<5} {backend:<12} normed ulps {ulp_distance(y, want_y)} "
                    f"residual bitwise {torch.equal(h, want_h)}")
        for key in KEYS:
            scale = {"fp8_static": torch.tensor([0.02], device=dev),
                     "nvfp4": torch.tensor([448 * 6 / 8.0], device=dev)}.get(key)
            got = av.fused_allreduce_gemma_rms_norm_quant(x.clone(), res, w, EPS, scale, key)
            op = av.op_for(H, torch.bfloat16, EPS, key=key, device=dev)
            served = op.backend_for(t) if t <= 2048 else "over budget"
            if got is None:
                rows.append(f"{key:<13} T={t:<5} None (serving: {served})")
                continue
            q, normed, resid = got
            layout = "swizzled_128x4" if key == "nvfp4" else None
            mine = quantize(normed, key, scale=scale, layout=layout)
            same = torch.equal(q.data.view(torch.uint8), mine.data.view(torch.uint8))
            frac = float((q.data.view(torch.uint8) != mine.data.view(torch.uint8)).float().mean())
            rows.append(f"{key:<13} T={t:<5} {served:<12} normed ulps {ulp_distance(normed, want_y)} residual "
                        f"bitwise {torch.equal(resid, want_h)} codes == Q(normed) {same} ({frac:.2e} differ)")
    av.close()
    return rows


if __name__ == "__main__":
    from arnorm.testing import run_ranks

    for line in run_ranks(2, rank_main, backend="gloo", timeout=400)[0]:
        print(line)
PY

cat >"$OUT/py/integ_gpu_graph.py" <<'PY'
"""TP 1: warmup(), then fused_allreduce_gemma_rms_norm captured in a CUDA graph and replayed."""
import torch

import arnorm
from arnorm.integrations import vllm as av
from arnorm.testing import ulp_distance

H, T, EPS = 4096, 16, 1e-6
dev = torch.device("cuda", 0)


class Norm(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(w, requires_grad=False), EPS


av.configure(group=arnorm.LOCAL, max_tokens=256)
av.warmup(H, torch.bfloat16, EPS, device=dev)
op = av.op_for(H, torch.bfloat16, EPS, device=dev)
print("backend at T=16:", op.backend_for(T))
norm = Norm((torch.randn(H, device=dev) * 0.2).bfloat16())
xs, res = torch.randn(T, H, device=dev).bfloat16(), torch.randn(T, H, device=dev).bfloat16()
av.fused_allreduce_gemma_rms_norm(xs.clone(), res, norm)  # the path for T is decided before capture
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    for _ in range(2):
        av.fused_allreduce_gemma_rms_norm(xs.clone(), res, norm)
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y, h = av.fused_allreduce_gemma_rms_norm(xs, res, norm)
worst, same_h = 0, True
for i in range(20):
    x = torch.randn(T, H, device=dev).bfloat16()
    xs.copy_(x)
    graph.replay()
    want_h = x + res
    hf = want_h.float()
    want = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + norm.weight.float())).bfloat16()
    worst = max(worst, ulp_distance(y, want))
    same_h &= torch.equal(h, want_h)
print(f"20 replays: normed max ulps {worst}, residual bitwise {same_h}")
raise SystemExit(0 if worst <= 1 and same_h else 1)
PY

python3 -c "import transformers; print('transformers', transformers.__version__, transformers.__file__)"
[ "${INTEG_CPU_TESTS:-0}" = 1 ] && step pytest_integrations 0 480 python3 -m pytest -q -p no:cacheprovider -rfs tests/integrations
step vllm_cuda_tp2 0 420 python3 "$OUT/py/integ_gpu_vllm.py"
step vllm_cuda_graph_tp1 0 240 python3 "$OUT/py/integ_gpu_graph.py"
step demo_llama_tp1 0 300 python3 -m arnorm demo --model llama --tp 1 --device cuda --max-tokens 8
step demo_gemma3_tp1 0 300 python3 -m arnorm demo --model gemma3 --tp 1 --device cuda --max-tokens 8
step demo_gemma3_tp1_fp32 0 300 python3 -m arnorm demo --model gemma3 --tp 1 --device cuda --dtype float32 \
  --max-tokens 8
# Two ranks sharing the one GPU: transformers' own TP model (DTensor collectives over gloo) crashed
# with SIGSEGV/SIGBUS in its unfused forward on 2026-12-03, so the demo refuses it (exit 2, one line).
step demo_llama_tp2_shared_gpu 2 120 python3 -m arnorm demo --model llama --tp 2 --device cuda --max-tokens 8

echo
echo "== summary (outputs under $OUT)"
printf '%s\n' "${SUMMARY[@]}"
