"""triton_symm's launcher on CPU: the grid, and the direct launch's arguments against kernel[grid]'s."""

from __future__ import annotations

import pytest
import torch

from arnorm.plugin import RMSNorm
from arnorm_triton import _kernels as K
from arnorm_triton._direct import Bound
from arnorm_triton.symm import _kernels as S
from arnorm_triton.symm import _launch as L
from arnorm_triton.symm._workspace import emulated, plan_layout

H = 64


def _launcher(quant=None, layout=None, world=2, slots=4):
    lay = plan_layout(world=world, slots=slots, hidden=H, itemsize=2, max_tokens=8, max_bytes=1 << 20,
                      oneshot_max=3)  # fmt: skip
    ws = emulated(lay, torch.bfloat16)[1]
    launcher = L.SymmLauncher(ws, quant=quant, layout=layout, write_normed=True,
                              norm=RMSNorm(weight_offset=1.0), soft=True, soft_fp8=True, sync=True,
                              spin_limit=100)  # fmt: skip
    return launcher, ws


def _tensors(t):
    x = torch.randn(t, H).to(torch.bfloat16)
    res, h, y = torch.randn_like(x), torch.zeros_like(x), torch.zeros_like(x)
    w = torch.ones(H, dtype=torch.bfloat16)
    q = torch.zeros(t, H, dtype=torch.uint8)
    sf = torch.zeros(t, 1, dtype=torch.float32)
    return x, res, w, None, h, y, q, sf


@pytest.fixture
def recorded(monkeypatch):
    """kernel[grid] and the compiled launcher replaced by recorders; the launcher bindable on CPU."""
    calls: dict[str, list] = {"ordinary": [], "direct": []}

    def fake_launcher(kernel, grid, warmup):
        def call(*args, **kwargs):
            calls["ordinary"].append((grid, args, kwargs))
            return "compiled"

        return call

    bound = Bound(run=lambda *a: calls["direct"].append(a), function="fn", mid=("m1", "m2"))
    monkeypatch.setattr(L, "_launcher", fake_launcher)
    monkeypatch.setattr(L, "bound_launchers", lambda compiled: [bound])
    monkeypatch.setattr(L, "_stream_getter", lambda: lambda index: 7)
    monkeypatch.setattr(K, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return calls


def _as_ints(args):
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def test_grid_is_rows_up_to_slots_plus_padding_programs():
    """The grid is min(T, slots) row programs, plus one program per 32 swizzled padding rows."""
    plain, _ = _launcher()
    swz, _ = _launcher("nvfp4", "swizzled_128x4")
    assert [plain.grid(t) for t in (1, 3, 4, 9, 128)] == [1, 3, 4, 4, 4]
    assert [swz.grid(t) for t in (1, 3, 4, 9, 128)] == [1 + 4, 3 + 4, 4 + 4, 4 + 4, 4 + 0]


def test_direct_launch_passes_what_kernel_grid_gets(recorded):
    """After bind, a launch calls the compiled launcher with the grid, stream, function and every
    kernel argument in signature order, exactly the values kernel[grid] receives."""
    launcher, _ = _launcher("fp8_per_token")
    assert launcher.bind(_tensors(3), 3, (H, H, H), two_shot=False)
    assert len(recorded["ordinary"]) == 1 + L.BIND_TRIALS - 1 and len(recorded["direct"]) == 1
    recorded["ordinary"].clear()
    recorded["direct"].clear()
    tensors = _tensors(2)
    launcher.launch(*tensors, 2, H, H, H, two_shot=True, copy_in=False, end_wait=True)
    launcher.unbind()
    launcher.launch(*tensors, 2, H, H, H, two_shot=True, copy_in=False, end_wait=True)
    (direct,), ((grid, args, kwargs),) = recorded["direct"], recorded["ordinary"]
    names = S.symm_allreduce_norm_kernel.arg_names
    consts = tuple(kwargs[n] for n in names[len(args) :])
    assert direct[:7] == (grid, 1, 1, 7, "fn", "m1", "m2")
    assert direct[7:] == _as_ints(args) + consts
    assert len(args) + len(consts) == len(names) and kwargs["STAGE"] == 0


def test_direct_launch_falls_back_when_specialization_differs(recorded):
    """A misaligned pointer or a stride of another divisibility goes through kernel[grid]; a
    bind whose direct launch writes other bytes keeps kernel[grid] and launches as often."""
    launcher, _ = _launcher()
    assert launcher.bind(_tensors(3), 3, (H, H, H), two_shot=False)
    recorded["ordinary"].clear()
    x, res, w, scale, h, y, q, sf = _tensors(2)
    odd = torch.zeros(2 * H + 1, dtype=torch.bfloat16)[1:].view(2, H)
    launcher.launch(odd, res, w, scale, h, y, q, sf, 2, H, H, H, two_shot=False, copy_in=True, end_wait=False)
    launcher.launch(
        x, res, w, scale, h, y, q, sf, 2, H + 8, H, H, two_shot=False, copy_in=True, end_wait=False
    )
    assert len(recorded["ordinary"]) == 2 and len(recorded["direct"]) == 1


def test_bind_launches_the_same_number_of_times_when_outputs_differ(recorded, monkeypatch):
    """A direct launch that writes other bytes than kernel[grid] is not kept, and bind still makes
    1 + BIND_TRIALS launches (the peers' flags stay in step)."""
    launcher, _ = _launcher()
    tensors = _tensors(3)
    bad = Bound(run=lambda *a: (recorded["direct"].append(a), tensors[4].fill_(1.0)), function="fn", mid=())
    monkeypatch.setattr(L, "bound_launchers", lambda compiled: [bad])
    assert not launcher.bind(tensors, 3, (H, H, H), two_shot=False)
    assert not launcher.fast
    assert len(recorded["ordinary"]) + len(recorded["direct"]) == 1 + L.BIND_TRIALS


def test_pdl_launches_with_launch_pdl_and_never_in_emulation(recorded):
    """pdl=True compiles USE_PDL in and launches with launch_pdl; the emulation (sync=False) never
    does (its stages run rank by rank, with no preceding grid to wait for)."""
    lay = plan_layout(world=2, slots=4, hidden=H, itemsize=2, max_tokens=8, max_bytes=1 << 20, oneshot_max=3,
                      push_max=3)  # fmt: skip
    ws = emulated(lay, torch.bfloat16)[0]
    kw = {"quant": None, "layout": None, "write_normed": True, "norm": RMSNorm(), "soft": True,
          "soft_fp8": True}  # fmt: skip
    for sync, expect in ((True, True), (False, False)):
        launcher = L.SymmLauncher(ws, sync=sync, pdl=True, **kw)
        assert launcher.constexprs["USE_PDL"] is expect
        launcher.launch(*_tensors(2), 2, H, H, H, push=True, two_shot=False, copy_in=True, end_wait=False)
        _, args, kwargs = recorded["ordinary"].pop()
        assert kwargs.get("launch_pdl", False) is expect
        # Every rank's address rides along as a scalar argument (0 past the world size).
        names = S.symm_allreduce_norm_kernel.arg_names
        peers = args[names.index("peer0") : names.index("peer7") + 1]
        assert peers == (*ws.addresses, *(0,) * (S.PEER_ARGS - 2))


@pytest.mark.parametrize(("platform", "arch", "expect"), [("cuda", (9, 0), True), ("cuda", (8, 9), False),
                                                          ("rocm", (9, 4), False)])  # fmt: skip
def test_pdl_available_needs_cuda_sm90_compiled(monkeypatch, platform, arch, expect):
    """PDL only on CUDA SM 9.0+ with compiled kernels (never in the interpreter)."""
    import types

    from arnorm_triton import _direct

    monkeypatch.setattr(K, "INTERPRETED", False)
    problem = types.SimpleNamespace(platform=platform, arch=arch)
    assert _direct.pdl_available(problem) is (expect and hasattr(__import__("triton").language.extra.cuda,
                                                                 "gdc_wait"))  # fmt: skip
    monkeypatch.setattr(K, "INTERPRETED", True)
    assert _direct.pdl_available(problem) is False
