"""Batch invariance of the Triton backends on CPU: the exact mode's pinned warp count, the batch-invariant
op's choice of exact mode, and triton_symm's push, one-shot and two-shot giving every row the bits it
gets alone (the kernels under the interpreter; docs/numerics.md, "Batch invariance")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import arnorm
from arnorm._problem import Problem
from arnorm.comm._comm import Comm
from arnorm_triton._backend import TritonBackend
from arnorm_triton._launch_table import default_num_warps

H = 4096
#: The emulation runs the real kernels: under the interpreter on CPU, compiled on a GPU host.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Rows of the emulated calls: small for the interpreter, a real width (16 elements per thread) on a GPU.
EMU_H = 4096 if DEVICE == "cuda" else 64


def _problem(**kw) -> Problem:
    base = Problem(
        world_size=1, hidden_size=H, dtype="bfloat16", eps=1e-6, weight_offset=0.0, quant=None,
        scale_layout=None, max_tokens=2048, normed_output=True, inplace=True, device_type="cpu",
        platform="cuda", arch=(9, 0),
    )  # fmt: skip
    return dataclasses.replace(base, **kw)


def _warps(exact: bool, problem: Problem) -> set[int]:
    # The launcher's configuration on an H200-class GPU (arch 9.0), built on CPU: no kernel runs.
    backend = TritonBackend(problem, Comm.resolve(arnorm.LOCAL, torch.device("cpu")), exact, pdl=False)
    return {backend.launcher.config(t).num_warps for t in range(1, problem.max_tokens + 1)}


def test_exact_mode_launches_every_token_count_with_one_warp_count():
    """The measured table changes the warp count (and the sum of squares' order) with T at H 4096;
    exact mode pins it to the shape's default, the count triton_symm uses."""
    assert len(_warps(False, _problem())) > 1  # the table this guards against
    assert _warps(True, _problem()) == {default_num_warps(H)}


@pytest.mark.parametrize("settings", [{}, {"exact": True}])
def test_batch_invariant_op_runs_triton_in_exact_mode(settings):
    """A batch-invariant op on triton runs the exact mode unless exact is set to 0."""
    from arnorm_triton._plugin import TritonSettings

    comm = Comm.resolve(arnorm.LOCAL, torch.device("cpu"))
    backend = TritonBackend.create(_problem(batch_invariant=True), comm, TritonSettings(**settings))
    assert backend.launcher.fixed_warps == default_num_warps(H)


def test_batch_invariant_op_refuses_triton_with_exact_set_to_0():
    """exact=False set explicitly contradicts batch invariance: triton's setup fails, saying so."""
    from arnorm_triton._plugin import TritonSettings

    comm = Comm.resolve(arnorm.LOCAL, torch.device("cpu"))
    expected = r"batch invariance: exact=False .*needs exact=True or unset"
    with pytest.raises(arnorm.ArnormError, match=expected):
        TritonBackend.create(_problem(batch_invariant=True), comm, TritonSettings(exact=False))


def _rows(world: int, pool: int, h: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(pool, h, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(world)]
    residual = (torch.randn(pool, h, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    weight = (1 + torch.randn(h, generator=g) * 0.2).to(torch.bfloat16).to(DEVICE)
    return partials, residual, weight


def _bits(out) -> dict[str, torch.Tensor]:
    rows = {"residual": out.residual.view(torch.int16), "normed": out.normed.view(torch.int16)}
    if out.quant is not None:
        rows["codes"] = out.quant.data.view(torch.uint8).reshape(out.residual.shape[0], -1)
        if out.quant.format == "fp8_per_token":
            rows["scales"] = out.quant.scale.view(torch.int32).reshape(-1, 1)
    return rows


@pytest.mark.parametrize("quant", [None, "fp8_per_token"])
@pytest.mark.parametrize("world", [2, 3])
def test_symm_push_one_shot_and_two_shot_give_every_row_its_bits_alone(quant, world):
    """Each row through the push one-shot alone, and in batches through the push, the flag one-shot
    and the two-shot (rows at other positions, programs and two-shot owners; 5 rows over 4 slots)
    gives bitwise the same residual, normed output, codes and scales on every rank."""
    from arnorm_triton.symm._emulation import emulate_call

    h, pool = EMU_H, 9
    partials, residual, weight = _rows(world, pool, h, seed=world)
    kw = {"quant": quant, "norm": arnorm.RMSNorm(weight_offset=1.0), "slots": 4}
    alone = []
    for i in range(pool):
        row = [p[i : i + 1] for p in partials]
        outs, _ = emulate_call(row, residual[i : i + 1], weight, None, push=True, **kw)
        alone.append([_bits(o) for o in outs])
    batches = (
        ([3, 1, 4, 0, 5], {"push": True}),
        ([8, 2, 6, 7, 1], {}),
        ([0, 8, 3, 5, 2], {"two_shot": True}),
        (list(range(pool)), {"two_shot": True}),
    )
    for rows, how in batches:
        outs, _ = emulate_call([p[rows] for p in partials], residual[rows], weight, None, **how, **kw)
        for rank, out in enumerate(outs):
            got = _bits(out)
            for name, bits in got.items():
                want = torch.cat([alone[i][rank][name] for i in rows])
                assert torch.equal(bits, want), f"{how} rank {rank}: {name} differs from the rows alone"


def test_symm_and_triton_exact_agree_on_every_row():
    """triton_symm's kernels and triton's exact mode share the epilogue and the warp count: on the same
    partials, every row's outputs are bitwise the same (the interpreter; the GPU run checks the GPU)."""
    from arnorm_triton._kernels import INTERPRETED
    from arnorm_triton._launch import FusedLauncher
    from arnorm_triton.symm._emulation import emulate_call

    world, t, h = 2, 5, EMU_H
    partials, residual, weight = _rows(world, t, h, seed=7)
    outs, _ = emulate_call(partials, residual, weight, None, push=True)
    launcher = FusedLauncher(hidden=h, itemsize=2, quant=None, layout=None, write_normed=True,
                             num_partials=world, norm=arnorm.RMSNorm(), soft=INTERPRETED,
                             soft_fp8=INTERPRETED, num_warps=default_num_warps(h))  # fmt: skip
    x = torch.cat(partials)
    h_out = torch.empty(t, h, dtype=torch.bfloat16, device=DEVICE)
    y = torch.empty(t, h, dtype=torch.bfloat16, device=DEVICE)
    launcher.launch(x, residual, weight, None, h_out, y, None, None, t, h, h, h)
    assert torch.equal(h_out.view(torch.int16), outs[0].residual.view(torch.int16))
    assert torch.equal(y.view(torch.int16), outs[0].normed.view(torch.int16))
