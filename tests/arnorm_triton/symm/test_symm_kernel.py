"""The triton_symm kernel's math on emulated ranks (Triton interpreter on CPU, compiled on a GPU).

Every rank's peer table points at the other ranks' workspaces in this process; the flag operations
are compiled out and the stages run rank by rank (arnorm_triton.symm._emulation). The sums must be
the reference's rank-order fp32 sum bit for bit, on every rank, and the outputs the contract's.
"""

from __future__ import annotations

import pytest
import torch
from triton_cases import (
    VARIANTS,
    assert_bitwise,
    assert_quant_equal,
    check_output,
    make_problem,
    make_scale,
    variant_id,
)

from arnorm.plugin import RMSNorm, add_rmsnorm, rank_order_sum
from arnorm_triton.symm._emulation import emulate_call
from arnorm_triton.symm._workspace import SENTINEL_BYTE

pytestmark = pytest.mark.slow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Wider than one quantization block per row, narrow enough for the interpreter.
H = 256


def _inputs(world: int, t: int, dtype=torch.bfloat16, offset: float = 0.0, seed: int = 0, h: int = H):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(t, h, generator=g).to(dtype).to(DEVICE) for _ in range(world)]
    res = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(h, generator=g) * 0.1 + (1.0 - offset)).to(dtype).to(DEVICE)
    return parts, res, w


def _check_all_ranks(outs, parts, res, w, problem, scale):
    """Every rank meets the contract with s = the reference's rank-order sum, and all ranks agree."""
    s = rank_order_sum(parts)
    for out in outs:
        check_output(out, s, res, w, problem, scale)
    first = outs[0]
    for out in outs[1:]:
        assert_bitwise(out.residual, first.residual, "residual across ranks")
        if first.normed is not None:
            assert_bitwise(out.normed, first.normed, "normed across ranks")
        if first.quant is not None:
            assert_quant_equal(out.quant, first.quant)


KINDS = {"one_shot": {}, "two_shot": {"two_shot": True}, "push": {"push": True}}
#: Every format with every protocol kind, the world size alternating between 2 and 4, so every
#: format also meets both world sizes and every kind both world sizes (pairwise, not the full
#: product: the format is the epilogue's business, the world and the kind the sum's, and the
#: two meet only through the sum, which every case checks bitwise). Half the interpreted calls.
FORMAT_CASES = [
    pytest.param(v, (2, 4)[(i + j) % 2], kind, id=f"{variant_id(v)}-{(2, 4)[(i + j) % 2]}-{kind}")
    for i, v in enumerate(VARIANTS)
    for j, kind in enumerate(KINDS)
]


@pytest.mark.parametrize(("variant", "world", "kind"), FORMAT_CASES)
def test_every_format_bitwise_on_every_rank(variant, world, kind):
    """2 and 4 ranks, push, one- and two-shot, every format: residual bitwise the reference's,
    normed within 1 ulp, codes bitwise quantize(normed), and all ranks bitwise identical (T = 9 rows
    over 4 programs: several rows per program, uneven shares)."""
    quant, layout = variant
    t = 9
    parts, res, w = _inputs(world, t, offset=1.0, seed=world)
    scale = make_scale(quant, add_rmsnorm(rank_order_sum(parts), res, w, 1e-6, 1.0)[1])
    problem = make_problem(
        H, torch.bfloat16, quant, layout, weight_offset=1.0, world_size=world, device=DEVICE
    )
    outs, _ = emulate_call(parts, res, w, scale, norm=RMSNorm(weight_offset=1.0), quant=quant, layout=layout,
                           slots=4, **KINDS[kind])  # fmt: skip
    _check_all_ranks(outs, parts, res, w, problem, scale)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_other_dtypes(dtype, kind):
    """fp16 and fp32 partials sum in fp32 in rank order and round once, as the reference."""
    parts, res, w = _inputs(3, 6, dtype, seed=3)
    problem = make_problem(H, dtype, world_size=3, device=DEVICE)
    outs, _ = emulate_call(parts, res, w, None, slots=3, **KINDS[kind])
    _check_all_ranks(outs, parts, res, w, problem, None)


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
def test_zero_copy_input_and_round_before_weight(two_shot):
    """Partials already in the inputs regions (zero-copy) give the same result; the residual then
    goes to a new tensor, not into the region the peers read. Llama's rounding order is served."""
    parts, res, w = _inputs(2, 5, seed=5)
    problem = make_problem(H, torch.bfloat16, "fp8_per_token", world_size=2, device=DEVICE,
                           round_before_weight=True)  # fmt: skip
    outs, wss = emulate_call(parts, res, w, None, quant="fp8_per_token",
                             norm=RMSNorm(round_before_weight=True), two_shot=two_shot, zero_copy=True,
                             slots=2)  # fmt: skip
    _check_all_ranks(outs, parts, res, w, problem, None)
    for out, ws in zip(outs, wss, strict=True):
        assert out.residual.data_ptr() != ws.inputs(5).data_ptr()


@pytest.mark.parametrize("kind", list(KINDS))
def test_normalize_unrounded(kind):
    """RMSNorm(normalize_unrounded=True) (vLLM 0.33's arithmetic) on every protocol: the norm reads
    the fp32 s + residual, the residual is the rounded sum, every rank agrees."""
    parts, res, w = _inputs(2, 5, dtype=torch.float16, offset=1.0, seed=7)
    problem = make_problem(H, torch.float16, "fp8_static", world_size=2, device=DEVICE, weight_offset=1.0,
                           normalize_unrounded=True)  # fmt: skip
    s = rank_order_sum(parts)
    _, y_ref = add_rmsnorm(s, res, w, 1e-6, 1.0, normalize_unrounded=True)
    scale = make_scale("fp8_static", y_ref)
    outs, _ = emulate_call(parts, res, w, scale, quant="fp8_static",
                           norm=RMSNorm(weight_offset=1.0, normalize_unrounded=True), slots=2,
                           **KINDS[kind])  # fmt: skip
    _check_all_ranks(outs, parts, res, w, problem, scale)
    _, y_rounded = add_rmsnorm(s, res, w, 1e-6, 1.0)
    assert (outs[0].normed != y_rounded).any(), "the kernel must read the unrounded sum"


def test_reused_workspace_across_token_counts_and_kinds():
    """One set of workspaces serves calls of different T, one-shot and two-shot in turn: rows map
    to programs the same way whatever T is, and stale rows of a longer call never leak in."""
    wss = None
    for i, (t, two) in enumerate([(9, True), (2, False), (7, True), (1, True), (8, False)]):
        parts, res, w = _inputs(4, t, seed=10 + i)
        problem = make_problem(H, torch.bfloat16, world_size=4, device=DEVICE)
        if wss is None:
            from arnorm_triton.symm._workspace import emulated, plan_layout

            lay = plan_layout(world=4, slots=4, hidden=H, itemsize=2, max_tokens=9, max_bytes=1 << 30,
                              oneshot_max=0)  # fmt: skip
            wss = emulated(lay, torch.bfloat16, DEVICE)
        outs, wss = emulate_call(parts, res, w, None, two_shot=two, workspaces=wss)
        _check_all_ranks(outs, parts, res, w, problem, None)


def test_per_rank_residuals_and_negative_zero_sums():
    """Each rank adds its own residual (the contract is per rank), and a row whose partials are all
    -0.0 sums to -0.0 as the reference's (the sum starts from rank 0's value, not from +0.0)."""
    parts, _, w = _inputs(2, 4, seed=7)
    for p in parts:
        p[1] = -0.0
    g = torch.Generator().manual_seed(8)
    residuals = [torch.randn(4, H, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    residuals[0][1] = -0.0
    problem = make_problem(H, torch.bfloat16, world_size=2, device=DEVICE)
    outs, _ = emulate_call(parts, residuals, w, None, slots=2)
    s = rank_order_sum(parts)
    assert bool(torch.signbit(s[1]).all())
    for out, res in zip(outs, residuals, strict=True):
        check_output(out, s, res, w, problem, None)
    assert bool(torch.signbit(outs[0].residual[1]).all())


def test_strided_rows_and_not_inplace():
    """Row-strided partials and residual ([T, H] views of wider rows) are read without a copy;
    with inplace=False the caller's partial is left untouched."""
    g = torch.Generator().manual_seed(9)
    wide = [torch.randn(5, H + 64, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    parts = [x[:, :H] for x in wide]
    res = torch.randn(5, H + 32, generator=g).to(torch.bfloat16).to(DEVICE)[:, :H]
    w = torch.ones(H, dtype=torch.bfloat16, device=DEVICE)
    problem = make_problem(H, torch.bfloat16, world_size=2, device=DEVICE, inplace=False)
    before = [p.clone() for p in parts]
    outs, _ = emulate_call(parts, res, w, None, inplace=False, slots=2)
    _check_all_ranks(outs, [p.contiguous() for p in parts], res, w, problem, None)
    for p, b in zip(parts, before, strict=True):
        assert torch.equal(p, b)


def test_single_row_and_unnormed_output():
    """T = 1 (one program) and normed_output=False with a quant format: the same codes as with the
    normed output written."""
    parts, res, w = _inputs(4, 1, seed=11)
    kw = {"quant": "mxfp8", "layout": "linear", "slots": 4}
    outs, _ = emulate_call(parts, res, w, None, normed=False, **kw)
    full, _ = emulate_call(parts, res, w, None, normed=True, **kw)
    h_ref, _ = add_rmsnorm(rank_order_sum(parts), res, w, 1e-6, 0.0)
    for out, ref in zip(outs, full, strict=True):
        assert out.normed is None
        assert_bitwise(out.residual, h_ref, "residual")
        assert_quant_equal(out.quant, ref.quant)


def _sentinel_bits(dtype):
    return torch.tensor([-1], dtype=torch.int16 if dtype.itemsize == 2 else torch.int32).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_push_sentinel_values_nan_and_negative_zero(dtype):
    """Push: an input element whose bits are the sentinel (all set) is summed as a NaN, not waited
    for; other NaNs stay NaN; all--0.0 rows stay -0.0; every other element is bitwise the
    reference's, on every rank."""
    parts, res, w = _inputs(3, 4, dtype, seed=13)
    parts[1][0, 5] = _sentinel_bits(dtype).to(DEVICE)[0]
    parts[0][1, 3] = float("nan")
    for p in parts:
        p[2] = -0.0
    res[2] = -0.0
    outs, wss = emulate_call(parts, res, w, None, push=True, slots=4)
    ref, _ = add_rmsnorm(rank_order_sum(parts), res, w, 1e-6, 0.0)
    nan = torch.isnan(ref)
    assert int(nan.sum()) == 2
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    for out in outs:
        assert torch.equal(torch.isnan(out.residual), nan)
        assert torch.equal(out.residual.view(bits)[~nan], ref.view(bits)[~nan])
        assert bool(torch.signbit(out.residual[2]).all())
    lay = wss[0].layout
    for ws in wss:  # every slot read is the sentinel again
        assert bool((ws.buffer[lay.push_off :] == SENTINEL_BYTE).all())


def test_push_slots_alternate_over_calls():
    """Push calls reuse the workspaces call after call (slot e % 2 per program), mixed with flag
    calls of other kinds and token counts: every result exact, the push region all sentinel after
    each call, and per program the epochs hold the call count, then the last flag call's epoch."""
    from arnorm_triton.symm._workspace import emulated, plan_layout

    lay = plan_layout(world=2, slots=4, hidden=H, itemsize=2, max_tokens=9, max_bytes=1 << 30, oneshot_max=5,
                      push_max=5)  # fmt: skip
    wss = emulated(lay, torch.bfloat16, DEVICE)
    calls = [(3, "push"), (5, "push"), (2, "one_shot"), (1, "push"), (9, "two_shot"), (4, "push"),
             (2, "push")]  # fmt: skip
    for i, (t, kind) in enumerate(calls):
        parts, res, w = _inputs(2, t, seed=20 + i)
        problem = make_problem(H, torch.bfloat16, world_size=2, device=DEVICE)
        outs, wss = emulate_call(parts, res, w, None, workspaces=wss, **KINDS[kind])
        _check_all_ranks(outs, parts, res, w, problem, None)
        assert all(bool((ws.buffer[lay.push_off :] == SENTINEL_BYTE).all()) for ws in wss)
    counts, last_flag = [0] * 4, [0] * 4
    for t, kind in calls:
        for b in range(min(t, 4)):
            counts[b] += 1
            if kind != "push":
                last_flag[b] = counts[b]
    for ws in wss:
        assert ws.epochs.tolist() == counts + last_flag
