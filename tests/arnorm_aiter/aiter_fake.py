"""A recording fake of the aiter modules ``arnorm_aiter`` uses, installed through ``sys.modules``.

Only the tests install it. ``FakeCustomAllreduce`` mirrors the real ``CustomAllreduce`` signatures
(aiter v0.1.19.post1 .. v0.1.20.post1: ``__init__(group, device, max_size, enable_register_for_capturing)``,
``fused_ar_rms(inp, res_inp, *, res_out, out, scale_out, w, eps, registered, use_1stage,
post_per_token_quant, out_hidden_dim, gemma_norm, emit_bf16)``, ``capture()``, ``close()``), so an
argument the backend misnames raises ``TypeError`` here. It records every call and computes its
outputs with :func:`arnorm_aiter._numerics.expected`, gathering the other ranks' partials over the
(gloo) group when torch.distributed runs, or from ``STATE.partials`` in a single process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import sys
import types
from typing import Any

import torch

from arnorm._problem import Problem
from arnorm_aiter import _numerics, _rules

MODULES = (
    "aiter",
    "aiter.dist",
    "aiter.dist.device_communicators",
    "aiter.dist.device_communicators.custom_all_reduce",
)
HIP = "6.4.43483-fake"


@dataclasses.dataclass
class State:
    """What the fake does and what it saw; reset by :func:`install`."""

    version: str | None = "0.1.20.post1"
    disabled: bool = False
    init_error: Exception | None = None
    register_for_capturing: bool = True
    world_size: int = 2  # single process only: the group's size
    rank: int = 0
    partials: list[torch.Tensor] | None = None  # single process only: every rank's partial
    inits: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: list[str] = dataclasses.field(default_factory=list)


STATE = State()


class FakeCustomAllreduce:
    def __init__(
        self, group: Any, device: Any, max_size: int = 1024**3, enable_register_for_capturing: bool = True
    ):
        STATE.inits.append({"group": group, "device": device, "max_size": max_size})
        if STATE.init_error is not None:
            raise STATE.init_error
        self.group, self.device, self.max_size = group, device, max_size
        self.disabled = STATE.disabled
        self.fully_connected = True
        self.enable_register_for_capturing = enable_register_for_capturing and STATE.register_for_capturing
        if isinstance(group, torch.distributed.ProcessGroup):
            self.rank, self.world_size = (
                torch.distributed.get_rank(group),
                torch.distributed.get_world_size(group),
            )
        else:
            self.rank, self.world_size = STATE.rank, STATE.world_size
        self._capturing = False

    def _partials(self, inp: torch.Tensor) -> list[torch.Tensor]:
        if isinstance(self.group, torch.distributed.ProcessGroup):
            parts = [torch.empty_like(inp) for _ in range(self.world_size)]
            torch.distributed.all_gather(parts, inp.contiguous(), group=self.group)
            return parts
        if STATE.partials is None:
            return [inp] * self.world_size
        assert torch.equal(STATE.partials[self.rank], inp), "the input is not this rank's partial"
        return list(STATE.partials)

    def fused_ar_rms(
        self,
        inp: torch.Tensor,
        res_inp: torch.Tensor,
        *,
        res_out: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        scale_out: torch.Tensor | None = None,
        w: torch.Tensor,
        eps: float,
        registered: bool = False,
        use_1stage: bool = False,
        post_per_token_quant: bool = False,
        out_hidden_dim: int = 0,
        gemma_norm: bool = False,
        emit_bf16: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        STATE.calls.append(
            {
                "inp": inp,
                "inp_copy": inp.clone(),
                "res_inp": res_inp,
                "res_out": res_out,
                "out": out,
                "scale_out": scale_out,
                "w": w,
                "eps": eps,
                "registered": registered,
                "use_1stage": use_1stage,
                "post_per_token_quant": post_per_token_quant,
                "out_hidden_dim": out_hidden_dim,
                "gemma_norm": gemma_norm,
                "emit_bf16": emit_bf16,
                "capturing": self._capturing,
            }
        )
        assert not self.disabled
        quant = "fp8_per_token" if post_per_token_quant else None
        h, y, codes, scale = _numerics.expected(
            self._partials(inp),
            res_inp,
            w,
            eps,
            1.0 if gemma_norm else 0.0,
            quant,
            self._stage(inp, use_1stage),
        )
        res_out = torch.empty_like(inp) if res_out is None else res_out
        res_out.copy_(h)
        if not post_per_token_quant:
            out = torch.empty_like(inp) if out is None else out
            out.copy_(y)
            return out, res_out
        assert out is not None and scale_out is not None  # the real one allocates its own otherwise
        out.copy_(codes)
        scale_out.copy_(scale)
        return (out, res_out, scale_out, y.clone()) if emit_bf16 else (out, res_out, scale_out)

    @staticmethod
    def _stage(inp: torch.Tensor, use_1stage: bool) -> bool:
        """The C++ launcher keeps the 1-stage kernel only when ``hidden / pack <= 1024``."""
        pack = 16 // inp.element_size()
        return use_1stage and inp.shape[-1] % pack == 0 and inp.shape[-1] // pack <= 1024

    @contextlib.contextmanager
    def capture(self):
        STATE.events.append("capture:enter")
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False
            STATE.events.append("capture:flush")

    def close(self) -> None:
        STATE.events.append("close")


def _module(name: str) -> types.ModuleType:
    leaf = name == MODULES[-1]
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=not leaf)
    if leaf:
        mod.CustomAllreduce = FakeCustomAllreduce  # type: ignore[attr-defined]
        mod.custom_ar = True  # type: ignore[attr-defined]
    else:
        mod.__path__ = []  # type: ignore[attr-defined]
    return mod


def install(monkeypatch: Any = None, **state: Any) -> State:
    """Put the fake modules in ``sys.modules``, make torch look like ROCm, pin aiter's version.

    With ``monkeypatch`` everything is undone after the test; without (a spawned rank) it stays.
    """
    global STATE
    STATE = State(**state)
    mods = {name: _module(name) for name in MODULES}
    if monkeypatch is None:
        sys.modules.update(mods)
        torch.version.hip = HIP  # type: ignore[attr-defined]
        _rules.installed_version = lambda: STATE.version  # type: ignore[assignment]
        return STATE
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.version, "hip", HIP, raising=False)
    monkeypatch.setattr(_rules, "installed_version", lambda: STATE.version)
    return STATE


def state() -> State:
    return STATE


def use_registry() -> None:
    """Make the reference and aiter (through its own hook) the process registry.

    The entry points of the installed (editable) metadata may predate ``aiter``'s; the hook is
    what a fresh install registers.
    """
    from arnorm.registry._builtin import arnorm_backends as reference_hook
    from arnorm.registry._discovery import Registry, reset_registry
    from arnorm_aiter._plugin import arnorm_backends

    reg = Registry()
    reg.add_from_hook("reference", reference_hook)
    reg.add_from_hook("aiter", arnorm_backends)
    reset_registry(reg)


class FakeComm:
    """A Comm stand-in for one process: ``gather_objects`` returns this rank's value plus ``others``."""

    def __init__(self, world_size: int = 2, rank: int = 0, others: list[Any] | None = None):
        self.group, self.cpu_group = "tp-group", "gloo-twin"
        self.world_size, self.rank = world_size, rank
        self.device = torch.device("cpu")
        self.others = others
        self.gathered: list[Any] = []

    def gather_objects(self, obj: Any) -> list[Any]:
        self.gathered.append(obj)
        others = self.others.pop(0) if self.others else [obj] * (self.world_size - 1)
        return [*others[: self.rank], obj, *others[self.rank :]]

    def barrier(self) -> None:
        pass


def problem(**overrides: Any) -> Problem:
    """A ROCm gfx950 problem, TP 2, hidden 4096, bf16, plain norm, no quant; override any field."""
    fields = {
        "world_size": 2,
        "hidden_size": 4096,
        "dtype": "bfloat16",
        "eps": 1e-6,
        "weight_offset": 0.0,
        "quant": None,
        "scale_layout": None,
        "max_tokens": 256,
        "normed_output": True,
        "inplace": True,
        "device_type": "cuda",
        "platform": "rocm",
        "arch": None,
        "gfx_arch": "gfx950",
    }
    fields.update(overrides)
    return Problem(**fields)


def inputs(world: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """Every rank's partial, the residual and a weight near 1 (Gemma stores ``weight - 1``)."""
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.2).to(dtype)
    return partials, residual, weight


# -- functions spawned ranks run (arnorm.testing.run_ranks imports them by name) -----------------


def rank_backend_vs_reference(
    rank: int, world: int, cases: list[dict[str, Any]]
) -> list[tuple[str, list[str]]]:
    """Build the aiter backend over the real gloo group with the fake installed; compare each case."""
    import arnorm
    from arnorm._reference import ReferenceBackend
    from arnorm.comm._comm import Comm
    from arnorm_aiter._backend import AiterBackend

    install()
    comm = Comm(torch.distributed.group.WORLD, torch.device("cpu"))
    results = []
    for case in cases:
        prob = problem(world_size=world, **{k: v for k, v in case.items() if k != "tokens"})
        dtype = getattr(torch, prob.dtype)
        partials, residual, weight = inputs(world, case["tokens"], prob.hidden_size, dtype, seed=len(results))
        backend = AiterBackend.create(prob, comm, arnorm.Config())
        x = partials[rank].clone()
        out = backend(x, residual, weight, None)
        ref = ReferenceBackend(prob, comm)(partials[rank].clone(), residual, weight, None)
        dev = _numerics.deviation(out, ref)
        problems = _numerics.violations(dev)
        if prob.inplace and out.residual is not x:
            problems.append("inplace: residual is not hidden_states")
        backend.close()
        results.append((str(dev), problems))
    return results


def rank_through_op(
    rank: int, world: int, cases: list[tuple[str | None, float]]
) -> list[tuple[str, str, list[str]]]:
    """The whole path: ``arnorm.AllReduceNorm`` on gloo picks aiter in auto mode (fake installed)."""
    import arnorm
    import arnorm.op._args
    from arnorm._reference import add_rmsnorm, quantize_output, rank_order_sum

    install()
    use_registry()
    # CPU tensors, ROCm as seen by selection
    arnorm.op._args.platform_of = lambda device: ("rocm", None, "gfx950")
    partials, residual, weight = inputs(world, 8, 1024, torch.bfloat16)
    results = []
    for quant, offset in cases:
        norm = arnorm.RMSNorm(1e-6, offset)
        with arnorm.AllReduceNorm(
            torch.distributed.group.WORLD,
            hidden_size=1024,
            dtype=torch.bfloat16,
            norm=norm,
            quant=quant,
            max_tokens=64,
        ) as op:
            x = partials[rank].clone()
            out = op(x, residual, weight)
            h, y = add_rmsnorm(rank_order_sum(partials), residual, weight, 1e-6, offset)
            ref = arnorm.Output(y, h, quantize_output(y, quant, None, None))
            problems = _numerics.violations(_numerics.deviation(out, ref))
            if out.residual is not x:
                problems.append("inplace: residual is not hidden_states")
            results.append((op.backend, str(op.explain()), problems))
    return results
