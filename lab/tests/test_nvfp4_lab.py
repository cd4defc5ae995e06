"""The nvfp4 lab kernels (lab/nvfp4_lab.py) write what the production kernel writes, bit
for bit: the single-FMA e2m1 rounding against the production one on every bf16 value and on fp32
values at and around every rounding tie, and every lab variant against the production kernel and
arnorm.quant on small rows (the Triton interpreter on CPU; the compiled kernels on a GPU).
"""

from __future__ import annotations

import importlib.util
import pathlib
import struct

import pytest
import torch
import triton
import triton.language as tl

from arnorm.quant import quantize
from arnorm_triton._casts import e2m1_code

_LAB_PATH = pathlib.Path(__file__).resolve().parents[2] / "lab" / "nvfp4_lab.py"
_spec = importlib.util.spec_from_file_location("nvfp4_lab", _LAB_PATH)
assert _spec is not None and _spec.loader is not None
lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab)

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"
EPS = 1e-6
# Infinities and 1e30-scaled rows overflow on purpose (numpy warns in the interpreter).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@triton.jit
def _both_codes(v_ptr, prod_ptr, fma_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n)
    tl.store(prod_ptr + offs, e2m1_code(v).to(tl.int32), mask=offs < n)
    tl.store(fma_ptr + offs, lab.e2m1_code_fma(v), mask=offs < n)


def _f32(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


def _probe_values() -> torch.Tensor:
    """Every bf16 value widened to fp32, and each e2m1 tie, grid point and binade edge with its
    fp32 neighbours (both signs), up to far beyond saturation."""
    bf16 = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    points = [
        0.25,
        0.5,
        0.75,
        1.0,
        1.25,
        1.5,
        1.75,
        2.0,
        2.5,
        3.0,
        3.5,
        4.0,
        5.0,
        6.0,
        7.0,
        8.0,
        2.0**-126,
        1e30,
    ]
    near = []
    for p in points:
        bits = struct.unpack("<I", struct.pack("<f", p))[0]
        near += [_f32(bits + d) for d in range(-3, 4)]
    near_t = torch.tensor(near, dtype=torch.float32)
    return torch.cat([bf16, near_t, -near_t, torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])])


def test_fma_e2m1_matches_production_rounding() -> None:
    """e2m1_code_fma gives the production e2m1 code for every non-NaN probe value."""
    v = _probe_values()
    v = v[~torch.isnan(v)].to(DEVICE)
    prod = torch.empty(v.numel(), dtype=torch.int32, device=DEVICE)
    fma = torch.empty_like(prod)
    block = 4096
    _both_codes[(triton.cdiv(v.numel(), block),)](v, prod, fma, v.numel(), BLOCK=block)
    bad = (prod != fma).nonzero().flatten()
    assert bad.numel() == 0, [(float(v[i]), int(prod[i]), int(fma[i])) for i in bad[:8]]


def _inputs(t: int, h: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((t, h), generator=g).to(torch.bfloat16)
    r = torch.randn((t, h), generator=g).to(torch.bfloat16)
    w = (torch.randn((h,), generator=g) * 0.1 + 1.0).to(torch.bfloat16)
    x[1] = 0  # a zero row (residual and x cancel to zeros)
    r[1] = 0
    if t > 2:
        x[2, : h // 2] *= 1e30  # large values beside small ones
    if t > 3:
        x[3, 5] = float("nan")  # a NaN row
    if t > 4:
        x[4, 17] = float("inf")
    return x.to(DEVICE), r.to(DEVICE), w.to(DEVICE)


def _run(launch, x, r, w, scale, *, normed: bool, swizzled: bool, weight_offset: float, **kw):
    t, h = x.shape
    hh = torch.empty_like(x)
    y = torch.empty_like(x) if normed else None
    q = torch.full((t, h // 2), 0xAB, dtype=torch.uint8, device=DEVICE)
    k = h // 16
    sf_shape = ((t + 127) // 128 * 128, (k + 3) // 4 * 4) if swizzled else (t, k)
    sf = torch.full(sf_shape, 0xCD, dtype=torch.uint8, device=DEVICE)
    soft = {} if ON_GPU else {"soft": True, "soft_fp8": True}
    launch(
        x, r, w, scale, hh, y, q, sf, eps=EPS, weight_offset=weight_offset, swizzled=swizzled, **soft, **kw
    )
    return hh, y, q, sf


CASES = [  # (T, H, swizzled, normed, weight offset): H = 80 and 208 are not multiples of 128
    (5, 80, True, True, 1.0),
    (6, 208, False, False, 0.0),
    (5, 256, True, False, 1.0),
]
SCALES = [336.0, 1.0e36, float("inf"), 0.0]


def _params() -> list:
    """Every (variant, case); in the quick set only the leading candidates on the first case (the
    interpreter takes about a second per pair), the rest marked slow."""
    out = []
    for variant in lab.VARIANTS:
        for i, case in enumerate(CASES):
            quick = i == 0 and variant in ("same_f_r2", "own_f_r2")
            marks = () if quick else (pytest.mark.slow,)
            out.append(pytest.param(variant, case, marks=marks, id=f"{variant}-T{case[0]}-H{case[1]}"))
    return out


@pytest.mark.parametrize(("variant", "case"), _params())
def test_lab_variant_matches_production(variant: str, case: tuple) -> None:
    """Residual bitwise the production kernel's; normed within 1 ulp of it (production took own_f's
    whole-block layout on 2026-12-03, and the two layouts associate the sum of squares
    differently); codes and block scales bitwise arnorm.quant of the variant's own normed output,
    and bitwise production's wherever normed is; for ordinary, huge, infinite and zero scales."""
    t, h, swizzled, normed, offset = case
    x, r, w = _inputs(t, h, seed=t * 1000 + h)
    for gs in SCALES:
        scale = torch.tensor([gs], device=DEVICE)
        warps = 2
        ref = _run(lab.launch_production, x, r, w, scale, normed=True, swizzled=swizzled,
                   weight_offset=offset,
                   num_warps=warps)  # fmt: skip
        got = _run(functools_partial(lab.launch_lab, variant), x, r, w, scale, normed=True, swizzled=swizzled,
                   weight_offset=offset, num_warps=warps)  # fmt: skip
        assert _same(got[0], ref[0]), "residual"
        ulp = (got[1].view(torch.int16).int() - ref[1].view(torch.int16).int()).abs()
        assert int(ulp[~torch.isnan(ref[1].float())].max()) <= 1, "normed"
        if gs == 336.0:
            qa = quantize(got[1], "nvfp4", scale=scale, layout="swizzled_128x4" if swizzled else "linear")
            assert torch.equal(got[2], qa.data), "codes vs arnorm.quant"
            assert torch.equal(got[3], qa.scale.view(torch.uint8)), "scales vs arnorm.quant"
        if _same(got[1], ref[1]):
            assert torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[3]), f"quantized at scale {gs}"
        if not normed:  # the variant without the normed output writes the same codes
            got2 = _run(functools_partial(lab.launch_lab, variant), x, r, w, scale, normed=False,
                        swizzled=swizzled,
                        weight_offset=offset, num_warps=warps)  # fmt: skip
            assert torch.equal(got2[2], got[2]) and torch.equal(got2[3], got[3])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def functools_partial(fn, variant):
    """``launch_lab`` bound to a variant, with :func:`_run`'s calling convention."""

    def call(*args, **kwargs):
        return fn(variant, *args, **kwargs)

    return call


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="the GPU round runs the script for real")
def test_bench_nvfp4_lab_smoke(tmp_path: pathlib.Path) -> None:
    """lab/bench_nvfp4_lab.py --smoke runs every check and timing step and reports them all ok."""
    import subprocess
    import sys

    script = _LAB_PATH.parent / "bench_nvfp4_lab.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    md = (tmp_path / "nvfp4-lab.md").read_text()
    assert "FAIL" not in md and "ERROR" not in md
    assert md.count(": ok") == 2 * len(lab.VARIANTS)
