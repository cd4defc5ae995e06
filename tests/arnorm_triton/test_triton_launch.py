"""The direct-launch plumbing of FusedLauncher, on CPU, against a stand-in for Triton's C launcher.

The stand-in takes exactly what ``JITFunction.run`` passes to ``CompiledKernel.run`` in Triton 3.6
and 3.8 — ``(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*every kernel argument in signature order, constexprs included)`` — and runs the interpreted
kernel with them, so argument order and the validation fallback are checked without a GPU.
"""

from __future__ import annotations

import types

import pytest
import torch
import triton
from triton_cases import make_inputs

import arnorm_triton._kernels as kernels
from arnorm.quant import quantize
from arnorm_triton._kernels import FusedLauncher

pytestmark = pytest.mark.skipif(not kernels.INTERPRETED, reason="CPU stand-in for the interpreter only")


class _FakeCompiled:
    """What ``kernel[grid](...)`` returns; ``run`` is the C launcher's calling convention."""

    def __init__(self, real, corrupt: bool) -> None:
        self.real, self.corrupt, self.calls = real, corrupt, 0
        self.function, self.packed_metadata = object(), object()

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_hook, *args):
        assert (gy, gz, stream, function, packed) == (1, 1, 0, self.function, self.packed_metadata)
        assert launch_metadata is None and enter is None and exit_hook is None
        names = self.real.arg_names
        assert len(args) == len(names), "every kernel argument, constexprs included, in signature order"
        self.calls += 1
        kwargs = dict(zip(names, args, strict=True))
        if self.corrupt:
            kwargs["eps"] = 0.5  # a launcher that binds arguments wrongly
        self.real[(gx,)](**kwargs)


class _FakeKernel:
    def __init__(self, real, corrupt: bool) -> None:
        self.real, self.arg_names = real, real.arg_names
        self.compiled = _FakeCompiled(real, corrupt)

    def __getitem__(self, grid):
        def launch(*args, num_warps, **constexprs):
            self.real[grid](*args, **constexprs)
            return self.compiled

        return launch


def _setup(monkeypatch, corrupt: bool):
    fake = _FakeKernel(kernels.fused_add_rmsnorm_quant_kernel, corrupt)
    monkeypatch.setattr(kernels, "fused_add_rmsnorm_quant_kernel", fake)
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda index: 0))
    monkeypatch.setattr(triton.runtime, "driver", driver)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def _launcher(quant: str | None = None, layout: str | None = None) -> FusedLauncher:
    return FusedLauncher(hidden=256, quant=quant, layout=layout, write_normed=True, num_partials=1, eps=1e-6,
                         weight_offset=1.0, soft=True, soft_fp8=True)  # fmt: skip


def _buffers(t: int, h: int):
    partials, res, w = make_inputs(t, h, torch.bfloat16)
    x = partials[0]
    q = torch.empty((t, h // 2), dtype=torch.uint8)
    sf = torch.empty((128, (h // 16 + 3) // 4 * 4), dtype=torch.uint8)
    scale = torch.tensor([100.0])
    return x, res, w, scale, torch.empty_like(x), torch.empty_like(x), q, sf


def test_direct_launch_binds_arguments_like_jit_run(monkeypatch):
    """The bound C-launcher call reproduces kernel[grid] bit for bit and is then used for every launch."""
    fake = _setup(monkeypatch, corrupt=False)
    launcher = _launcher("nvfp4", "swizzled_128x4")
    ptrs = _buffers(3, 256)
    assert launcher.enable_fast_path(ptrs, ptrs[4:], 3) and launcher.fast
    assert fake.compiled.calls == 1  # the validation launch went through the direct path
    expect = [o.clone() for o in ptrs[4:]]
    for o in ptrs[4:]:
        o.zero_()
    assert launcher.launch(*ptrs, n_rows=3) is None
    assert fake.compiled.calls == 2
    for a, b in zip(ptrs[4:], expect, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    expect_q = quantize(ptrs[5], "nvfp4", scale=ptrs[3], layout="swizzled_128x4")
    assert torch.equal(ptrs[6], expect_q.data) and torch.equal(ptrs[7], expect_q.scale.view(torch.uint8))


def test_direct_launch_that_disagrees_is_dropped(monkeypatch, caplog):
    """A direct launch whose outputs differ from kernel[grid] is not kept: launches stay ordinary."""
    fake = _setup(monkeypatch, corrupt=True)
    launcher = _launcher()
    ptrs = _buffers(2, 256)
    assert not launcher.enable_fast_path(ptrs, ptrs[4:6], 2) and not launcher.fast
    assert "disagrees" in caplog.text
    launcher.launch(*ptrs, n_rows=2)
    assert fake.compiled.calls == 1  # only the validation attempt


def test_misaligned_pointer_takes_the_ordinary_path(monkeypatch):
    """A hidden_states view that is not 16-byte aligned never reaches the specialized direct launch."""
    fake = _setup(monkeypatch, corrupt=False)
    launcher = _launcher()
    ptrs = _buffers(2, 256)
    assert launcher.enable_fast_path(ptrs, ptrs[4:6], 2)
    flat = torch.empty(2 * 256 + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(2, 256)  # 2-byte offset
    shifted.copy_(ptrs[0])
    launcher.launch(shifted, *ptrs[1:], n_rows=2)
    assert fake.compiled.calls == 1


@pytest.mark.parametrize(
    ("quant", "layout", "normed"),
    [
        (None, None, True),
        ("fp8_per_token", None, True),
        ("nvfp4", "swizzled_128x4", False),
        ("mxfp8", "linear", False),
    ],
)
def test_backend_warm_up_binds_the_direct_launch(monkeypatch, quant, layout, normed):
    """TritonBackend's warm-up validates the direct launch for each output set, and calls then use it."""
    from triton_cases import check_output, make_backend, make_problem, make_scale

    from arnorm.plugin import add_rmsnorm

    problem = make_problem(256, torch.bfloat16, quant, layout, normed_output=normed)
    backend = make_backend(problem)
    fake = _setup(monkeypatch, corrupt=False)
    assert backend._warm_up() and backend.launcher.fast
    partials, res, w = make_inputs(3, 256, torch.bfloat16)
    scale = make_scale(quant, add_rmsnorm(partials[0], res, w, 1e-6, 0.0)[1])
    out = backend(partials[0].clone(), res, w, scale)
    assert fake.compiled.calls == 2
    check_output(out, partials[0], res, w, problem, scale)
