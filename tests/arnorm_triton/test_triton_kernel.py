"""The triton backend at TP 1, driven directly: every format, dtype and norm against the contract.

Without a CUDA GPU these run in the Triton interpreter on the CPU (small shapes); with one, the same
tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton_cases import (
    DTYPES,
    VARIANTS,
    assert_bitwise,
    assert_quant_equal,
    check_output,
    make_backend,
    make_inputs,
    make_problem,
    make_scale,
    variant_id,
)

from arnorm.plugin import FORMAT_SPECS, add_rmsnorm
from arnorm.quant import dequantize, quantize, swizzle_128x4
from arnorm_triton._kernels import _swizzled_offset

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _shape(quant: str | None) -> tuple[int, int]:
    # nvfp4 / mxfp8 are the slowest in the interpreter: keep them to [T <= 8, H <= 1024].
    return (5, 512) if quant in ("nvfp4", "mxfp8") else (7, 1000 if quant is None else 1024)


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_tp1_matches_contract(variant, dtype, offset):
    """Residual bitwise, normed within 1 ulp, quant bitwise equal to quantize(kernel normed)."""
    quant, layout = variant
    t, h = _shape(quant)
    partials, residual, weight = make_inputs(t, h, dtype, weight_offset=offset, device=DEVICE)
    s = partials[0]
    scale = make_scale(quant, add_rmsnorm(s, residual, weight, 1e-6, offset)[1])
    problem = make_problem(h, dtype, quant, layout, weight_offset=offset, device=DEVICE)
    backend = make_backend(problem)
    x = s.clone()
    out = backend(x, residual, weight, scale)
    assert out.residual is x
    check_output(out, s, residual, weight, problem, scale)


@pytest.mark.parametrize("variant", [("nvfp4", "swizzled_128x4"), ("mxfp8", "linear")], ids=variant_id)
def test_not_inplace_and_no_normed_output(variant):
    """inplace=False leaves hidden_states alone; normed_output=False returns no normed but the same quant."""
    quant, layout = variant
    partials, residual, weight = make_inputs(3, 256, torch.bfloat16, device=DEVICE)
    scale = make_scale(quant, add_rmsnorm(partials[0], residual, weight, 1e-6, 0.0)[1])
    full = make_backend(make_problem(256, torch.bfloat16, quant, layout, inplace=False, device=DEVICE))
    lean = make_backend(make_problem(256, torch.bfloat16, quant, layout, normed_output=False, device=DEVICE))
    x = partials[0].clone()
    a = full(x, residual, weight, scale)
    assert a.residual is not x and torch.equal(x, partials[0])
    b = lean(x, residual, weight, scale)
    assert b.normed is None and b.residual is x and torch.equal(b.residual, a.residual)
    assert_quant_equal(b.quant, a.quant)


def _prefill_quant_outputs(backend) -> None:
    """Make ``backend`` pre-fill the codes and scales it allocates with 0x55, so bytes a kernel
    leaves unwritten (padding) show."""
    alloc = backend._alloc

    def dirty_alloc(t):
        outs = alloc(t)
        for o in outs[1:3]:
            o.view(torch.uint8).fill_(0x55)
        return outs

    backend._alloc = dirty_alloc


def test_swizzled_padding_is_written():
    """Swizzled scales: the padding rows and columns are written as zeros, not left to the allocator
    (the outputs are pre-filled with 0x55); on a GPU T = 129 also spans two 128-row tiles."""
    t = 129 if DEVICE.type == "cuda" else 3  # every interpreted row costs ~0.1 s
    partials, residual, weight = make_inputs(t, 96, torch.bfloat16, device=DEVICE)
    scale = make_scale("nvfp4", add_rmsnorm(partials[0], residual, weight, 1e-6, 0.0)[1])
    problem = make_problem(96, torch.bfloat16, "nvfp4", "swizzled_128x4", max_tokens=256, device=DEVICE)
    backend = make_backend(problem)
    _prefill_quant_outputs(backend)
    out = backend(partials[0].clone(), residual, weight, scale)
    assert out.quant.scale.shape == ((t + 127) // 128 * 128, 8)  # K = 6 scale columns pad to 8
    check_output(out, partials[0], residual, weight, problem, scale)


@pytest.mark.parametrize("normed", [True, False], ids=["normed", "unnormed"])
@pytest.mark.parametrize("quant", ["nvfp4", "mxfp8"])
def test_two_pass_scale_store_writes_the_same_bytes(quant, normed):
    """Swizzled scales stored in two passes (linear, then the swizzle kernel) equal the one-pass
    store byte for byte, padding rows and columns included (outputs pre-filled with 0x55)."""
    t, h = (130, 2080) if DEVICE.type == "cuda" else (3, 320)  # K = 130 / 65 columns: padded to 4
    partials, residual, weight = make_inputs(t, h, torch.bfloat16, device=DEVICE)
    scale = make_scale(quant, add_rmsnorm(partials[0], residual, weight, 1e-6, 0.0)[1])
    problem = make_problem(h, torch.bfloat16, quant, "swizzled_128x4", normed_output=normed, max_tokens=256,
                           device=DEVICE)  # fmt: skip
    backend = make_backend(problem)
    _prefill_quant_outputs(backend)
    got = []
    for two_pass in (False, True):
        backend.launcher.fixed_two_pass = two_pass
        backend.launcher.unbind()
        assert backend.launcher.config(t).two_pass is two_pass
        out = backend(partials[0].clone(), residual, weight, scale)
        outs = (out.residual, out.normed, out.quant.data, out.quant.scale)
        got.append([o.view(torch.uint8).clone() for o in outs if o is not None])
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))
    check_output(out, partials[0], residual, weight, problem, scale)


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp8"])
def test_problem_without_a_layout_gets_the_formats_default(quant):
    """A Problem built directly with scale_layout=None (the core always resolves it; a caller driving
    the backend need not): the kernel writes the layout the output says, the format's default (until
    2026-12-04 it wrote linear scales under a swizzled_128x4 label)."""
    partials, residual, weight = make_inputs(2, 64, torch.bfloat16, device=DEVICE)
    scale = make_scale(quant, add_rmsnorm(partials[0], residual, weight, 1e-6, 0.0)[1])
    problem = make_problem(64, torch.bfloat16, quant, None, device=DEVICE)
    out = make_backend(problem)(partials[0].clone(), residual, weight, scale)
    assert problem.scale_layout is None
    assert out.quant.layout == FORMAT_SPECS[quant].default_layout
    check_output(out, partials[0], residual, weight, make_problem(64, torch.bfloat16, quant, out.quant.layout,
                 device=DEVICE), scale)  # fmt: skip


@pytest.mark.parametrize(
    "variant", [(None, None), ("fp8_per_token", None), ("nvfp4", "linear")], ids=variant_id
)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).removeprefix("torch.")
)
def test_round_before_weight(variant, dtype):
    """RMSNorm(round_before_weight=True): normed within 1 ulp of add_rmsnorm(round_before_weight=True)
    (bitwise on most elements), residual bitwise, quant bitwise equal to quantize(kernel normed)."""
    quant, layout = variant
    partials, residual, weight = make_inputs(4, 256, dtype, weight_offset=1.0, device=DEVICE)
    s = partials[0]
    _, y_ref = add_rmsnorm(s, residual, weight, 1e-6, 1.0, round_before_weight=True)
    scale = make_scale(quant, y_ref)
    problem = make_problem(
        256, dtype, quant, layout, weight_offset=1.0, round_before_weight=True, device=DEVICE
    )
    out = make_backend(problem)(s.clone(), residual, weight, scale)
    check_output(out, s, residual, weight, problem, scale)
    _, y_once = add_rmsnorm(s, residual, weight, 1e-6, 1.0, round_before_weight=False)
    assert not torch.equal(y_once, y_ref), "the two orders must differ on these inputs for the test to bite"
    assert (out.normed == y_ref).float().mean() > 0.99


@pytest.mark.parametrize("rbw", [False, True], ids=["once", "rbw"])
@pytest.mark.parametrize("variant", [(None, None), ("fp8_static", None)], ids=variant_id)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).removeprefix("torch.")
)
def test_normalize_unrounded(variant, dtype, rbw):
    """RMSNorm(normalize_unrounded=True): the norm reads the fp32 s + residual (vLLM 0.33's
    fused_add_rms_norm), the residual is still the rounded sum; within 1 ulp of the reference
    (bitwise on most elements), and measurably not the rounded-sum arithmetic."""
    quant, layout = variant
    partials, residual, weight = make_inputs(4, 256, dtype, weight_offset=1.0, device=DEVICE)
    s = partials[0]
    _, y_ref = add_rmsnorm(s, residual, weight, 1e-6, 1.0, rbw, normalize_unrounded=True)
    scale = make_scale(quant, y_ref)
    problem = make_problem(256, dtype, quant, layout, weight_offset=1.0, round_before_weight=rbw,
                           normalize_unrounded=True, device=DEVICE)  # fmt: skip
    out = make_backend(problem)(s.clone(), residual, weight, scale)
    check_output(out, s, residual, weight, problem, scale)
    _, y_rounded = add_rmsnorm(s, residual, weight, 1e-6, 1.0, rbw, normalize_unrounded=False)
    assert not torch.equal(y_rounded, y_ref), "the two sums must differ on these inputs for the test to bite"
    assert (out.normed == y_ref).float().mean() > 0.99
    assert (out.normed != y_rounded).any()


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out_of_place"])
@pytest.mark.parametrize("variant", [(None, None), ("mxfp8", "swizzled_128x4")], ids=variant_id)
def test_strided_rows(variant, inplace):
    """[T, H] views with row stride > H (hidden_states and residual) are read and written in place
    without a copy: the padding columns stay untouched and the outputs meet the contract."""
    quant, layout = variant
    t, h = 5, 256
    partials, residual, weight = make_inputs(t, h, torch.bfloat16, device=DEVICE)
    wide_x = torch.full((t, h + 48), 7.0, dtype=torch.bfloat16, device=DEVICE)
    wide_r = torch.full((t, h + 80), 9.0, dtype=torch.bfloat16, device=DEVICE)
    wide_x[:, 16 : 16 + h] = partials[0]
    wide_r[:, :h] = residual
    x, r = wide_x[:, 16 : 16 + h], wide_r[:, :h]
    assert not x.is_contiguous() and x.stride(0) == h + 48
    problem = make_problem(h, torch.bfloat16, quant, layout, inplace=inplace, device=DEVICE)
    out = make_backend(problem)(x, r, weight, None)
    check_output(out, partials[0], residual, weight, problem, None)
    assert (out.residual is x) == inplace
    if not inplace:
        assert torch.equal(x, partials[0])
    assert bool((wide_x[:, :16] == 7.0).all()) and bool((wide_x[:, 16 + h :] == 7.0).all())
    assert torch.equal(wide_r[:, :h], residual) and bool((wide_r[:, h:] == 9.0).all())


@triton.jit
def _offsets_kernel(out_ptr, ROWS: tl.constexpr, KP: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    blk = tl.arange(0, KP)[None, :]
    tl.store(out_ptr + rows * KP + blk, _swizzled_offset(rows, blk, KP))


def test_swizzled_offset_formula_matches_swizzle_128x4():
    """The in-kernel 128x4 offset of every (m, k) over four row tiles equals arnorm.quant's swizzle."""
    rows, kp = 512, 8
    offsets = torch.empty((rows, kp), dtype=torch.int32, device=DEVICE)
    _offsets_kernel[(1,)](offsets, ROWS=rows, KP=kp)
    offsets = offsets.cpu().flatten().long()
    index = torch.arange(rows * kp, dtype=torch.int32).view(rows, kp)
    for shift in (0, 8):  # the index needs two bytes: check each through the byte-wise swizzle
        byte = ((index >> shift) & 0xFF).to(torch.uint8)
        assert torch.equal(swizzle_128x4(byte).flatten()[offsets], byte.flatten())


def _edge_rows(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that hit the quantizers' corners: zeros, huge, tiny, mixed magnitudes, a NaN, an inf."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(8, hidden, generator=g)
    rows[0] = 0.0
    rows[1] *= 1e4 if dtype != torch.float16 else 1e2
    rows[2] *= 1e-30 if dtype != torch.float16 else 1e-3
    rows[3, ::32] *= 1e3  # one large value per 32-block: the rest of each block rounds to zero codes
    rows[4, 5] = float("nan")
    rows[5, 9] = float("inf")
    rows[6] = -rows[6].abs() * 1e-3  # all negative and small: signed zero codes
    return rows.to(dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter, on NaN / inf
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[0] is not None], ids=variant_id)
def test_edge_rows_quantize_like_the_reference(variant, dtype):
    """Zero, huge, tiny, NaN and inf rows: codes and scales bitwise equal to quantize(kernel normed)."""
    quant, layout = variant
    h = 256
    x = _edge_rows(h, dtype).to(DEVICE)
    residual = torch.zeros_like(x)
    weight = torch.ones(h, dtype=dtype, device=DEVICE)
    problem = make_problem(h, dtype, quant, layout, device=DEVICE)
    scale = {"fp8_static": torch.tensor([0.01]), "nvfp4": torch.tensor([1000.0])}.get(quant)
    scale = None if scale is None else scale.to(DEVICE)
    out = make_backend(problem)(x.clone(), residual, weight, scale)
    assert_bitwise(out.residual, x, "residual")
    assert_quant_equal(out.quant, quantize(out.normed, quant, scale=scale, layout=layout))


@pytest.mark.parametrize("layout", ["linear", "swizzled_128x4"])
@pytest.mark.parametrize("scale", [-672.0, -1e-3, -1e30], ids=["moderate", "tiny", "huge"])
def test_nvfp4_negative_global_scale_is_the_contract(layout, scale):
    """A negative nvfp4 global scale gives negative block scales and codes of y's own sign, bitwise
    quantize(kernel normed) (the kernel once decoded SF without its sign and flipped every code)."""
    partials, residual, weight = make_inputs(5, 256, torch.bfloat16, device=DEVICE)
    s = torch.tensor([scale], device=DEVICE)
    out = make_backend(make_problem(256, torch.bfloat16, "nvfp4", layout, device=DEVICE))(
        partials[0].clone(), residual, weight, s
    )
    assert_quant_equal(out.quant, quantize(out.normed, "nvfp4", scale=s, layout=layout))
    y = out.normed.float()
    assert torch.equal(
        torch.sign(dequantize(out.quant)) * (y != 0), torch.sign(y) * (dequantize(out.quant) != 0)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_eps_and_non_power_of_two_hidden(dtype):
    """A large eps and H = 1000 (masked lanes) still meet the contract."""
    partials, residual, weight = make_inputs(4, 1000, dtype, device=DEVICE)
    residual = residual * 0.01
    problem = make_problem(1000, dtype, "fp8_per_token", eps=0.5, device=DEVICE)
    out = make_backend(problem)(partials[0].clone() * 0.01, residual, weight, None)
    check_output(out, partials[0] * 0.01, residual, weight, problem, None)
