"""The direct-launch plumbing of FusedLauncher, on CPU, against a stand-in for Triton's C launcher.

The stand-in takes exactly what ``JITFunction.run`` passes to ``CompiledKernel.run`` in Triton 3.6
and 3.8 — ``(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*every kernel argument in signature order, constexprs included)`` — with pointers as plain
integers (as the direct launch passes them), maps them back to the tensors and runs the
interpreted kernel, so argument order and the validation fallback are checked without a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import types
import warnings

import pytest
import torch
import triton
from triton_cases import make_inputs

import arnorm_triton._direct as direct_module
import arnorm_triton._kernels as kernels
import arnorm_triton._launch as launch_module
import arnorm_triton._swizzle as swizzle_module
from arnorm.plugin import RMSNorm
from arnorm.quant import quantize
from arnorm_triton._launch import FusedLauncher

pytestmark = pytest.mark.skipif(not kernels.INTERPRETED, reason="CPU stand-in for the interpreter only")


class _FakeCompiled:
    """What ``kernel[grid](...)`` returns; ``run`` is the C launcher's calling convention."""

    def __init__(self, real, corrupt: bool, typed: dict[str, torch.Tensor]) -> None:
        self.real, self.corrupt, self.calls, self.typed = real, corrupt, 0, typed
        self.function, self.packed_metadata = object(), object()

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_hook, *args):
        assert (gz, stream, function, packed) == (1, 0, self.function, self.packed_metadata)
        assert launch_metadata is None and enter is None and exit_hook is None
        names = self.real.arg_names
        assert len(args) == len(names), "every kernel argument, constexprs included, in signature order"
        self.calls += 1
        kwargs = dict(zip(names, args, strict=True))
        for name in names:
            if name.endswith("_ptr"):
                assert isinstance(kwargs[name], int), "pointers go to the launcher as plain integers"
                kwargs[name] = _at(kwargs[name], self.typed[name])
        kwargs["USE_PDL"] = False  # griddepcontrol is GPU-only; the interpreter runs without it
        if self.corrupt:
            kwargs["eps"] = 0.5  # a launcher that binds arguments wrongly
        self.real[(gx, gy)](**kwargs)


def _at(address: int, like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``like``'s dtype at a raw address (what the integer pointer names), reaching
    exactly to the end of the live storage that holds it: the interpreter copies a pointer
    argument's whole tensor in and back out, so a view past the allocation would write stale
    bytes over whatever the heap put there meanwhile."""
    end = 0
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:  # fake tensors an earlier torch.compile left alive have no data pointer
                storage = obj.untyped_storage()
                start = storage.data_ptr()
            except RuntimeError:
                continue
            if start <= address < start + storage.nbytes():
                end = max(end, start + storage.nbytes())
    assert end, f"no live tensor holds address {address:#x}"
    nbytes = (end - address) // like.element_size() * like.element_size()
    raw = (ctypes.c_byte * nbytes).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(like.dtype)


class _FakeKernel:
    """``kernel[grid](...)`` runs the interpreted kernel and remembers each pointer argument's
    dtype (as the kernel sees it), so the fake launcher can turn integers back into tensors."""

    def __init__(self, real, corrupt: bool) -> None:
        self.real, self.arg_names = real, real.arg_names
        self.typed: dict[str, torch.Tensor] = {}
        self.compiled = _FakeCompiled(real, corrupt, self.typed)
        self.options: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, launch_pdl=False, **constexprs):
            self.options.append({"num_warps": num_warps, "launch_pdl": launch_pdl})
            for name, a in zip(self.arg_names, args, strict=False):
                if isinstance(a, torch.Tensor):
                    self.typed[name] = a
            self.real[grid](*args, **{**constexprs, "USE_PDL": False})
            return self.compiled

        return launch


def _setup(monkeypatch, corrupt: bool):
    fake = _FakeKernel(kernels.fused_add_rmsnorm_quant_kernel, corrupt)
    monkeypatch.setattr(kernels, "fused_add_rmsnorm_quant_kernel", fake)
    swizzle = _FakeKernel(swizzle_module.swizzle_block_scales_kernel, False)
    monkeypatch.setattr(swizzle_module, "swizzle_block_scales_kernel", swizzle)
    fake.swizzle = swizzle
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    assert launch_module.K is kernels
    driver = types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda index: 0))
    monkeypatch.setattr(triton.runtime, "driver", driver)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def _launcher(quant: str | None = None, layout: str | None = None, **kw) -> FusedLauncher:
    fixed = {"hidden": 256, "itemsize": 2, "write_normed": True, "num_partials": 1, "soft": True}
    norm = RMSNorm(weight_offset=1.0)
    return FusedLauncher(quant=quant, layout=layout, norm=norm, soft_fp8=True, **fixed, **kw)


def _buffers(t: int, h: int, quant: str | None = "nvfp4"):
    partials, res, w = make_inputs(t, h, torch.bfloat16)
    x = partials[0]
    q = torch.empty((t, h // 2 if quant == "nvfp4" else h), dtype=torch.uint8)
    sf = torch.empty((128, (h // (32 if quant == "mxfp8" else 16) + 3) // 4 * 4), dtype=torch.uint8)
    scale = torch.tensor([100.0])
    return x, res, w, scale, torch.empty_like(x), torch.empty_like(x), q, sf


def _bind(launcher: FusedLauncher, ptrs, outputs, t: int) -> bool:
    # After an Inductor compile in the same process (another test file on this xdist worker), torch
    # warns on data_ptr() of tensors this test made; under the suite's warnings-as-errors bind would
    # then fall back to kernel[grid] and the test would judge the fallback, not the binding.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return launcher.bind(ptrs, outputs, t, (256, 256, 256), launcher.configs(64))


def test_direct_launch_binds_arguments_like_jit_run(monkeypatch):
    """The bound launcher call reproduces kernel[grid] bit for bit and is then used for every launch."""
    fake = _setup(monkeypatch, corrupt=False)
    launcher = _launcher("nvfp4", "swizzled_128x4")
    ptrs = _buffers(3, 256)
    assert _bind(launcher, ptrs, ptrs[4:], 3) and launcher.fast
    assert fake.compiled.calls == 1  # the validation launch went through the direct path
    expect = [o.clone() for o in ptrs[4:]]
    for o in ptrs[4:]:
        o.zero_()
    assert launcher.launch(*ptrs, 3, 256, 256, 256) is None
    assert fake.compiled.calls == 2
    for a, b in zip(ptrs[4:], expect, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    expect_q = quantize(ptrs[5], "nvfp4", scale=ptrs[3], layout="swizzled_128x4")
    assert torch.equal(ptrs[6], expect_q.data) and torch.equal(ptrs[7], expect_q.scale.view(torch.uint8))


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp8"])
def test_two_pass_direct_launch_makes_both_launches(monkeypatch, quant):
    """A two-pass launch binds both kernels' launchers: the direct call fills a scratch buffer of
    its own, swizzles it into the scales, and writes what the one-pass kernel writes, padding too."""
    fake = _setup(monkeypatch, corrupt=False)
    one, two = (
        _launcher(quant, "swizzled_128x4", two_pass=False),
        _launcher(quant, "swizzled_128x4", two_pass=True),
    )
    ptrs = _buffers(3, 256, quant)
    assert two.config(3).two_pass and not one.config(3).two_pass and two.grid_rows(3) == 3
    assert _bind(two, ptrs, ptrs[4:], 3) and two.fast
    assert (fake.compiled.calls, fake.swizzle.compiled.calls) == (1, 1)  # the validation, direct
    for o in ptrs[4:]:
        o.view(torch.uint8).fill_(0x55)
    assert two.launch(*ptrs, 3, 256, 256, 256) is None
    assert (fake.compiled.calls, fake.swizzle.compiled.calls) == (2, 2)
    got = [o.clone() for o in ptrs[4:]]
    for o in ptrs[4:]:
        o.view(torch.uint8).fill_(0x55)
    one.launch(*ptrs, 3, 256, 256, 256)  # unbound: kernel[grid], the scales swizzled in-kernel
    for a, b in zip(got, ptrs[4:], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_direct_launch_that_disagrees_is_dropped(monkeypatch, caplog):
    """A direct launch whose outputs differ from kernel[grid] is not kept: launches stay ordinary."""
    fake = _setup(monkeypatch, corrupt=True)
    launcher = _launcher()
    ptrs = _buffers(2, 256)
    assert not _bind(launcher, ptrs, ptrs[4:6], 2) and not launcher.fast
    assert "disagrees" in caplog.text
    launcher.launch(*ptrs, 2, 256, 256, 256)
    assert fake.compiled.calls == 1  # only the validation attempt


def test_misaligned_pointer_takes_the_ordinary_path(monkeypatch):
    """A hidden_states view that is not 16-byte aligned never reaches the specialized direct launch."""
    fake = _setup(monkeypatch, corrupt=False)
    launcher = _launcher()
    ptrs = _buffers(2, 256)
    assert _bind(launcher, ptrs, ptrs[4:6], 2)
    flat = torch.empty(2 * 256 + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(2, 256)  # 2-byte offset
    shifted.copy_(ptrs[0])
    launcher.launch(shifted, *ptrs[1:], 2, 256, 256, 256)
    assert fake.compiled.calls == 1


def test_stride_that_breaks_the_specialization_takes_the_ordinary_path(monkeypatch):
    """A row stride not divisible by 16 (the compiled kernel assumed it is) launches ordinarily,
    and a strided view whose stride keeps the specialization goes direct."""
    fake = _setup(monkeypatch, corrupt=False)
    launcher = _launcher()
    ptrs = _buffers(2, 256)
    assert _bind(launcher, ptrs, ptrs[4:6], 2)
    wide = torch.zeros(2, 264, dtype=torch.bfloat16)  # stride 264 = 16 * 16.5
    wide[:, :256] = ptrs[0]
    launcher.launch(wide[:, :256], *ptrs[1:], 2, 264, 256, 256)
    assert fake.compiled.calls == 1
    wider = torch.zeros(2, 272, dtype=torch.bfloat16)
    wider[:, :256] = ptrs[0]
    launcher.launch(wider[:, :256], *ptrs[1:], 2, 272, 256, 256)
    assert fake.compiled.calls == 2


def test_pdl_launch_option_and_config_per_token_count(monkeypatch):
    """A PDL launcher compiles with launch_pdl; each configuration the table yields is bound once."""
    import arnorm_triton._launch_table as table

    fake = _setup(monkeypatch, corrupt=False)
    monkeypatch.setitem(table.TABLE, (9, 256, 0, True, 2), ((1, 2), (16, 4)))
    launcher = _launcher(pdl=True, arch=(9, 0))
    assert [launcher.config(t).num_warps for t in (1, 2, 16, 17, 1000)] == [2, 4, 4, 4, 4]
    ptrs = _buffers(2, 256)
    assert _bind(launcher, ptrs, ptrs[4:6], 2)
    assert fake.options == [{"num_warps": 2, "launch_pdl": True}, {"num_warps": 4, "launch_pdl": True}]


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


class _KnownLauncher:
    """A launcher object shaped like Triton 3.6's ``CudaLauncher``: ``launch`` is the C function,
    called as ``(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
    packed, launch_metadata, enter_hook, exit_hook, *kernel args)``."""

    def __init__(self, compiled: _FakeCompiled, scratch: int = 0) -> None:
        self.compiled, self.raw_calls = compiled, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.global_scratch_size = self.profile_scratch_size = scratch

    def launch(self, gx, gy, gz, stream, function, coop, pdl, gscratch, pscratch, *rest):
        assert (coop, pdl, gscratch, pscratch) == (False, True, None, None)
        self.raw_calls += 1
        self.compiled.calls -= 1  # counted as a raw launch, not as a call of run
        _FakeCompiled.run(self.compiled, gx, gy, gz, stream, function, *rest)

    def __call__(self, gx, gy, gz, stream, function, *args):
        _FakeCompiled.run(self.compiled, gx, gy, gz, stream, function, *args)


def _know(monkeypatch, cls) -> None:
    import hashlib
    import inspect

    text = " ".join(inspect.getsource(cls.__call__).split())
    monkeypatch.setattr(direct_module, "KNOWN_CALL_SOURCES", {hashlib.sha256(text.encode()).hexdigest()})


def test_a_launcher_of_known_source_is_called_through_its_c_launch(monkeypatch):
    """With the launcher's __call__ source known and no scratch, launches call its launch directly,
    bit for bit as kernel[grid]; anything else keeps the launcher object."""
    fake = _setup(monkeypatch, corrupt=False)
    known = _KnownLauncher(fake.compiled)
    monkeypatch.setattr(fake.compiled, "run", known)
    _know(monkeypatch, _KnownLauncher)
    bounds = direct_module.bound_launchers(fake.compiled)
    assert [b.run for b in bounds] == [known.launch, known]
    assert bounds[0].mid == (False, True, None, None, fake.compiled.packed_metadata, None, None, None)
    launcher = _launcher("nvfp4", "swizzled_128x4")
    ptrs = _buffers(3, 256)
    assert _bind(launcher, ptrs, ptrs[4:], 3) and known.raw_calls == 1
    expect = [o.clone() for o in ptrs[4:]]
    for o in ptrs[4:]:
        o.zero_()
    launcher.launch(*ptrs, 3, 256, 256, 256)
    assert known.raw_calls == 2
    for a, b in zip(ptrs[4:], expect, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    monkeypatch.setattr(fake.compiled, "run", _KnownLauncher(fake.compiled, scratch=64))
    assert [b.run for b in direct_module.bound_launchers(fake.compiled)] == [fake.compiled.run]
    monkeypatch.setattr(direct_module, "KNOWN_CALL_SOURCES", frozenset())
    assert [b.run for b in direct_module.bound_launchers(fake.compiled)] == [fake.compiled.run]


def test_a_launch_hook_sends_launches_the_ordinary_way(monkeypatch):
    """A profiler's launch-enter hook (Triton's knobs) is honoured: no direct launch while it is set."""
    fake = _setup(monkeypatch, corrupt=False)
    launcher = _launcher()
    ptrs = _buffers(2, 256)
    assert _bind(launcher, ptrs, ptrs[4:6], 2)
    chain = triton.knobs.runtime.launch_enter_hook

    def hook(*args):
        return None

    chain.add(hook)
    try:
        launcher.launch(*ptrs, 2, 256, 256, 256)
        assert fake.compiled.calls == 1  # only the validation launch at bind went direct
    finally:
        chain.remove(hook)
    launcher.launch(*ptrs, 2, 256, 256, 256)
    assert fake.compiled.calls == 2


def _pointers(ptrs) -> tuple[int, ...]:
    x, res, w, scale, h, y, q, sf = ptrs
    return (x.data_ptr(), res.data_ptr(), w.data_ptr(), scale.data_ptr(), h.data_ptr(), y.data_ptr(),
            q.data_ptr(), sf.data_ptr())  # fmt: skip


def test_rows_launcher_launches_contiguous_rows_like_launch(monkeypatch):
    """The eager fast path's launcher goes direct for aligned contiguous rows, bit for bit as launch."""
    fake = _setup(monkeypatch, corrupt=False)
    launcher = _launcher("nvfp4", "swizzled_128x4")
    ptrs = _buffers(3, 256)
    assert _bind(launcher, ptrs, ptrs[4:], 3)
    expect = [o.clone() for o in ptrs[4:]]
    for o in ptrs[4:]:
        o.zero_()
    assert launcher.rows_launcher()(3, *_pointers(ptrs))
    assert fake.compiled.calls == 2
    for a, b in zip(ptrs[4:], expect, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_rows_launcher_refuses_what_launch_would_send_the_ordinary_way(monkeypatch):
    """A misaligned input, an unbound launcher or a profiler's hook: go() launches nothing and says so."""
    fake = _setup(monkeypatch, corrupt=False)
    launcher = _launcher()
    ptrs = _buffers(2, 256)
    go = launcher.rows_launcher()
    assert not go(2, *_pointers(ptrs))  # not bound yet
    assert _bind(launcher, ptrs, ptrs[4:6], 2)
    p = _pointers(ptrs)
    for i in range(3):  # x, residual, weight two bytes off
        assert not go(2, *p[:i], p[i] + 2, *p[i + 1 :])
    assert not go(2, *p[:4], p[4] + 2, *p[5:])  # the residual output
    chain = triton.knobs.runtime.launch_enter_hook

    def hook(*args):
        return None

    chain.add(hook)
    try:
        assert not go(2, *p)
    finally:
        chain.remove(hook)
    assert fake.compiled.calls == 1  # only the validation launch at bind
    assert go(2, *p) and fake.compiled.calls == 2


def test_kernel_codes_and_launch_table_keys_are_the_format_tables_codes():
    """The kernels' QUANT and the tuned tables' keys are ``FormatSpec.code`` (pinned in
    tests/test_formats.py), never a format's place in the table."""
    from arnorm.plugin import FORMAT_SPECS
    from arnorm_triton import _launch_table

    assert {None: 0, **{n: s.code for n, s in FORMAT_SPECS.items()}} == kernels.QUANT_CODES
    for name in ("fp8_static", "fp8_per_token", "nvfp4", "mxfp8"):
        assert getattr(kernels, "_" + name.upper()).value == FORMAT_SPECS[name].code
    known = set(kernels.QUANT_CODES.values())
    for key in (*_launch_table.TABLE, *_launch_table.TWO_PASS_FROM):
        assert key[2] in known, key
    assert {key[2] for key in _launch_table.TWO_PASS_FROM} == {FORMAT_SPECS["nvfp4"].code}


def test_norm_constexprs_are_the_declared_options_in_capitals():
    """One constexpr per option triton declares, each a parameter of both kernels (the fused one and
    triton_symm's); an option it does not declare is refused, never launched as the default."""
    from arnorm_triton._launch import norm_constexprs
    from arnorm_triton._plugin import CAPABILITIES
    from arnorm_triton.symm import _kernels as symm_kernels

    declared = sorted(CAPABILITIES.norm_options)
    assert norm_constexprs(RMSNorm()) == {n.upper(): False for n in declared}
    for name in declared:
        assert norm_constexprs(RMSNorm(**{name: True}))[name.upper()] is True
        assert name.upper() in kernels.fused_add_rmsnorm_quant_kernel.arg_names
        assert name.upper() in symm_kernels.symm_allreduce_norm_kernel.arg_names
    none = CAPABILITIES.model_copy(update={"norm_options": frozenset()})
    with pytest.MonkeyPatch.context() as m:
        m.setattr(launch_module, "CAPABILITIES", none)
        with pytest.raises(ValueError, match="norm options"):
            norm_constexprs(RMSNorm(round_before_weight=True))
