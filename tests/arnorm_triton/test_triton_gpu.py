"""The compiled kernels on a CUDA GPU: the issue's shape grid, every format, CUDA graphs, NCCL ranks.

Run on a GPU host with ``python -m pytest tests/arnorm_triton -m "gpu or multigpu"``; everything
here skips cleanly without one.
"""

from __future__ import annotations

import pytest
import torch
import triton_cases
from triton_cases import (
    DTYPES,
    VARIANTS,
    assert_quant_equal,
    check_output,
    make_backend,
    make_problem,
    make_scale,
    variant_id,
)

from arnorm.plugin import add_rmsnorm

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 128, 1000, 8192]
HIDDEN = [2048, 4096, 5120, 8192, 16384]


def _inputs(t: int, h: int, dtype: torch.dtype, offset: float, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((t, h), generator=g, device="cuda").to(dtype)
    res = torch.randn((t, h), generator=g, device="cuda").to(dtype)
    w = (torch.randn((h,), generator=g, device="cuda") * 0.1 + (1.0 - offset)).to(dtype)
    return x, res, w


def _run(variant, t, h, dtype, offset, **kw):
    quant, layout = variant
    x, res, w = _inputs(t, h, dtype, offset)
    scale = make_scale(quant, add_rmsnorm(x, res, w, 1e-6, offset)[1])
    problem = make_problem(
        h, dtype, quant, layout, weight_offset=offset, max_tokens=max(t, 8), device="cuda", **kw
    )
    backend = make_backend(problem)
    out = backend(x.clone(), res, w, scale)
    check_output(out, x, res, w, problem, scale)
    return backend


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("h", HIDDEN)
def test_issue_shape_grid_bf16(h, variant, t):
    """bf16, Gemma norm, every format at T in {1, 7, 128, 1000, 8192} x H in {2048 .. 16384}."""
    _run(variant, t, h, torch.bfloat16, 1.0)


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize(("t", "h"), [(7, 5120), (1000, 4096)])
def test_dtypes_and_norms(t, h, variant, dtype, offset):
    """fp16 / fp32 / bf16 with plain and Gemma weights at two shapes, every format."""
    _run(variant, t, h, dtype, offset)


class _NoOrdinaryLaunch:
    def __getitem__(self, grid):
        raise AssertionError("kernel[grid] was called: the direct launcher was bypassed")


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_hardware_casts_and_direct_launch_are_used(variant, monkeypatch):
    """On SM 8.9+ the kernel uses the hardware bf16 / e4m3 casts, and every call after setup, at
    token counts in every bucket of the launch table, goes through the validated direct launcher
    (never kernel[grid]); on SM 9.0+ with programmatic dependent launch."""
    import arnorm_triton._kernels as kernels

    quant, _ = variant
    problem = make_problem(4096, torch.bfloat16, quant, variant[1], max_tokens=2048, device="cuda")
    backend = make_backend(problem)
    c = backend.launcher.constexprs
    assert c["SOFT"] is False
    if torch.cuda.get_device_capability() >= (8, 9) and not torch.version.hip:
        assert c["SOFT_FP8"] is False
    if torch.cuda.get_device_capability() >= (9, 0) and not torch.version.hip:
        assert backend.launcher.pdl, "programmatic dependent launch is off on SM 9.0+"
    assert backend.fast_launch, "the direct launcher was not validated on this Triton version"
    monkeypatch.setattr(kernels, "fused_add_rmsnorm_quant_kernel", _NoOrdinaryLaunch())
    for t in (1, 7, 17, 129, 1025, 2048):
        x, res, w = _inputs(t, 4096, torch.bfloat16, 0.0, seed=t)
        scale = make_scale(quant, add_rmsnorm(x, res, w, 1e-6, 0.0)[1])
        out = backend(x.clone(), res, w, scale)
        check_output(out, x, res, w, problem, scale)


@pytest.mark.parametrize(
    "variant", [(None, None), ("nvfp4", "swizzled_128x4"), ("mxfp8", "linear")], ids=variant_id
)
def test_strided_rows_and_round_before_weight_on_gpu(variant):
    """Strided [T, H] views (row strides 4096 + 64, divisible by 16: the direct launch) and
    round_before_weight on the compiled kernel: contract met, padding columns untouched."""
    quant, layout = variant
    t, h = 300, 4096
    x, res, w = _inputs(t, h, torch.bfloat16, 1.0, seed=5)
    problem = make_problem(h, torch.bfloat16, quant, layout, weight_offset=1.0, max_tokens=512, device="cuda",
                           round_before_weight=True)  # fmt: skip
    backend = make_backend(problem)
    wide_x = torch.full((t, h + 64), 3.0, dtype=torch.bfloat16, device="cuda")
    wide_r = torch.full((t, h + 64), 5.0, dtype=torch.bfloat16, device="cuda")
    wide_x[:, :h], wide_r[:, :h] = x, res
    scale = make_scale(quant, add_rmsnorm(x, res, w, 1e-6, 1.0, round_before_weight=True)[1])
    out = backend(wide_x[:, :h], wide_r[:, :h], w, scale)
    check_output(out, x, res, w, problem, scale)
    assert bool((wide_x[:, h:] == 3.0).all()) and bool((wide_r[:, h:] == 5.0).all())


@pytest.mark.parametrize(
    ("variant", "two_pass"),
    [((None, None), None), (("fp8_static", None), None), (("nvfp4", "swizzled_128x4"), None),
     (("nvfp4", "swizzled_128x4"), True)],
    ids=["none", "fp8_static", "nvfp4-swizzled", "nvfp4-swizzled-two-pass"],
)  # fmt: skip
def test_cuda_graph_capture_and_replay(variant, two_pass):
    """A captured call replays on new inputs and matches an eager call bit for bit. Two-pass: T 4096
    takes the table's two-pass store through the direct launch, its scratch allocated inside the
    capture; the eager call it is compared with takes one pass."""
    quant, layout = variant
    t, h = (4096, 4096) if two_pass else (37, 4096)
    problem = make_problem(h, torch.bfloat16, quant, layout, weight_offset=1.0, max_tokens=t, device="cuda")
    backend = make_backend(problem)
    eager_backend = make_backend(problem)
    if two_pass:
        eager_backend.launcher.fixed_two_pass = False
        eager_backend.launcher.unbind()
        assert backend.launcher.config(t).two_pass and backend.launcher.fast
    x0, res0, w = _inputs(t, h, torch.bfloat16, 1.0, seed=1)
    scale = make_scale(quant, add_rmsnorm(x0, res0, w, 1e-6, 1.0)[1])
    x, res = x0.clone(), res0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend(x.clone(), res, w, scale)  # warm-up on the side stream, as capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend(x, res, w, scale)
    for seed in (2, 3):
        xn, rn, _ = _inputs(t, h, torch.bfloat16, 1.0, seed=seed)
        x.copy_(xn)
        res.copy_(rn)
        graph.replay()
        eager = eager_backend(xn.clone(), rn, w, scale)
        torch.cuda.synchronize()
        assert torch.equal(captured.residual, eager.residual) and torch.equal(captured.normed, eager.normed)
        if quant is not None:
            assert_quant_equal(captured.quant, eager.quant)
        check_output(captured, xn, rn, w, problem, scale)


def test_nan_and_saturation_rows_on_gpu():
    """Hardware casts follow arnorm.quant's NaN / saturation / signed-zero conventions too."""
    from arnorm.quant import quantize

    h = 4096
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, h, generator=g)
    x[0] = 0.0
    x[1] *= 1e4
    x[2, 7] = float("nan")
    x[3, ::32] *= 1e3
    x[4] = -x[4].abs() * 1e-3
    x = x.to(torch.bfloat16).cuda()
    for quant, layout in [v for v in VARIANTS if v[0] is not None]:
        problem = make_problem(h, torch.bfloat16, quant, layout, device="cuda")
        scale = {"fp8_static": torch.tensor([0.01]), "nvfp4": torch.tensor([1000.0])}.get(quant)
        scale = None if scale is None else scale.cuda()
        out = make_backend(problem)(
            x.clone(), torch.zeros_like(x), torch.ones(h, dtype=torch.bfloat16).cuda(), scale
        )
        assert_quant_equal(out.quant, quantize(out.normed, quant, scale=scale, layout=layout))


@pytest.mark.multigpu
@pytest.mark.parametrize("exact", [False, True], ids=["all_reduce", "exact"])
def test_nccl_ranks(exact):
    """2+ GPUs over NCCL: all-reduce mode meets the contract given NCCL's sum; exact mode is bitwise."""
    from arnorm.testing import run_ranks

    world = min(torch.cuda.device_count(), 4)
    cases = [
        (q, layout, torch.bfloat16, 1.0, t, 4096, inplace)
        for (q, layout) in VARIANTS
        for t, inplace in [(1, True), (300, False)]
    ]
    results = run_ranks(world, triton_cases.gpu_rank_cases, cases, exact, backend="nccl")
    assert results == [[]] * world
