"""A recording fake of the parts of ``flashinfer.comm`` that ``arnorm_flashinfer`` uses (tests only).

``install()`` puts ``flashinfer``, ``flashinfer.comm`` and the submodules the backend imports into
``sys.modules`` (through ``monkeypatch`` when given, so each test gets its own). The fake:

* mirrors the 0.7.x signatures (``inspect.signature`` sees them) and records every call with the
  keyword arguments that were actually passed;
* validates what FlashInfer's TRT-LLM path needs but does not itself check (every buffer of the
  pattern present, contiguous, ``rms_gamma`` in the input dtype, an fp32 ``[1]`` scale tensor,
  ``use_oneshot`` a bool, two-shot only with more tokens than ranks, tokens within the workspace);
* computes the outputs on CPU like the kernel (rank-order fp32 sum, add, RMSNorm, then arnorm's
  quantizers written in FlashInfer's buffer layout). With a real torch.distributed group (the
  multi-rank tests) it all-gathers the partials over it; otherwise every rank's partial is taken
  to equal this one's.
"""

from __future__ import annotations

import functools
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

P = types.SimpleNamespace(
    kAllReduce=0,
    kARResidualRMSNorm=1,
    kARResidualRMSNormFP8Quant=2,
    kARResidualRMSNormFP4Quant=3,
    kARResidualRMSNormOutFP8Quant=4,
    kARResidualRMSNormOutFP4Quant=5,
    kARResidualRMSNormDynamicFP8Quant=10,
    kARResidualRMSNormOutDynamicFP8Quant=11,
    kARResidualRMSNormMXFP8Quant=13,
    kARResidualRMSNormOutMXFP8Quant=14,
)
#: pattern -> (norm_out written, quant format)
PATTERN_INFO: dict[int, tuple[bool, str | None]] = {
    1: (True, None),
    2: (False, "fp8_static"),
    3: (False, "nvfp4"),
    4: (True, "fp8_static"),
    5: (True, "nvfp4"),
    10: (False, "fp8_per_token"),
    11: (True, "fp8_per_token"),
    13: (False, "mxfp8"),
    14: (True, "mxfp8"),
}
LAYOUT_NAMES = {0: "swizzled_128x4", 1: "swizzled_8x4", 2: "linear"}


@dataclass
class FakeState:
    """What the fake saw, and knobs to make it fail."""

    version: str = "0.7.4"
    creates: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    builds: list[str] = field(default_factory=list)
    workspaces: list[Any] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    module_refs: dict[int, Any] = field(default_factory=dict)  # trtllm_ar._symm_workspace_refs
    fail_build: str | None = None
    fail_create: str | None = None
    multicast: bool = False
    confidential: bool = False

    @property
    def last_call(self) -> dict[str, Any]:
        return self.calls[-1]


class TorchDistBackend:
    def __init__(self, group: Any = None) -> None:
        self.group = group


class FakeWorkspace:
    def __init__(self, state: FakeState, kwargs: dict[str, Any]) -> None:
        self.state = state
        self.kwargs = kwargs
        self.world_size = kwargs["world_size"]
        self.rank = kwargs["rank"]
        self.max_token_num = kwargs["max_token_num"]
        self.hidden_dim = kwargs["hidden_dim"]
        self.dtype = kwargs["dtype"]
        self.group = kwargs["group"]
        self._backend = kwargs["backend"]
        self.destroy_count = 0
        self.ipc_handles = [[id(self)]]
        state.module_refs[id(self.ipc_handles)] = self
        self.sufficient_calls: list[tuple[Any, ...]] = []

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def destroyed(self) -> bool:
        return self.destroy_count > 0

    def is_buffer_size_sufficient(self, tp_size, num_tokens, hidden_dim, dtype, use_oneshot=None) -> bool:
        self.sufficient_calls.append((tp_size, num_tokens, hidden_dim, dtype))
        return (
            tp_size == self.world_size
            and num_tokens * hidden_dim <= self.max_token_num * self.hidden_dim
            and (dtype == torch.float32) == (self.dtype == torch.float32)
        )

    def destroy(self) -> None:
        self.destroy_count += 1
        if hasattr(self, "ipc_handles"):
            del self.ipc_handles  # as FlashInfer's destroy(): drops attributes, not the module's refs


def _create_signature(
    backend="auto",
    world_size=None,
    rank=None,
    max_token_num=None,
    hidden_dim=None,
    dtype=None,
    gpus_per_node=None,
    comm_backend=None,
    force_oneshot_support=False,
    group=None,
): ...


def _fusion_signature(
    input,
    workspace,
    pattern,
    launch_with_pdl=False,
    trigger_completion_at_end=True,
    output=None,
    residual_out=None,
    norm_out=None,
    quant_out=None,
    scale_out=None,
    residual_in=None,
    rms_gamma=None,
    rms_eps=1e-6,
    scale_factor=None,
    layout_code=None,
    use_oneshot=None,
    fp32_acc=False,
    block_quant_group_size=None,
    weight_bias=0.0,
): ...


def _bound(sig_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    import inspect

    bound = inspect.signature(sig_fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"fake flashinfer: {msg}")


def _partials(x: torch.Tensor, ws: FakeWorkspace) -> list[torch.Tensor]:
    import torch.distributed as dist

    group = ws.group
    if isinstance(group, dist.ProcessGroup):
        parts = [torch.empty_like(x) for _ in range(ws.world_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return parts
    return [x] * ws.world_size


def _compute(a: dict[str, Any], ws: FakeWorkspace) -> None:
    from arnorm._reference import add_rmsnorm, rank_order_sum

    x = a["input"]
    s = rank_order_sum(_partials(x, ws))
    h, y = add_rmsnorm(s, a["residual_in"], a["rms_gamma"], a["rms_eps"], a["weight_bias"])
    a["residual_out"].copy_(h)
    has_norm, fmt = PATTERN_INFO[a["pattern"]]
    if has_norm:
        a["norm_out"].copy_(y)
    if fmt is None:
        return
    from arnorm import quant

    layout = LAYOUT_NAMES.get(a["layout_code"] if a["layout_code"] is not None else 0)
    if fmt in ("fp8_static", "fp8_per_token"):
        q = quant.quantize(y, fmt, scale=a["scale_factor"] if fmt == "fp8_static" else None)
        a["quant_out"].copy_(q.data)
        if fmt == "fp8_per_token":
            a["scale_out"].copy_(q.scale)
        return
    if layout == "swizzled_8x4":
        q = quant.quantize(y, fmt, scale=a["scale_factor"] if fmt == "nvfp4" else None)
        a["quant_out"].copy_(q.data.view(a["quant_out"].dtype))
        return  # the real kernel writes no scales for 8x4
    q = quant.quantize(y, fmt, scale=a["scale_factor"] if fmt == "nvfp4" else None, layout=layout)
    a["quant_out"].copy_(q.data.view(a["quant_out"].dtype))
    flat = a["scale_out"]
    _require(
        flat.dim() == 1, f"scale_out: {flat.dim()}-D (the fake expects the 1-D view FlashInfer documents)"
    )
    src = q.scale.contiguous().view(torch.uint8).view(-1)
    _require(flat.numel() >= src.numel(), f"scale_out: {flat.numel()} elements (needs {src.numel()})")
    flat.view(torch.uint8)[: src.numel()].copy_(src)


def _check_fusion(a: dict[str, Any], state: FakeState) -> None:
    x, ws, pattern = a["input"], a["workspace"], a["pattern"]
    _require(isinstance(ws, FakeWorkspace) and not ws.destroyed, "workspace: destroyed or foreign")
    _require(pattern in PATTERN_INFO, f"pattern {pattern}: not one the backend should use")
    if pattern in (13, 14):
        _require(
            hasattr(P_for(state), "kARResidualRMSNormMXFP8Quant"), "MXFP8 pattern on a version without it"
        )
    has_norm, fmt = PATTERN_INFO[pattern]
    for name in ("input", "residual_in", "residual_out", "rms_gamma"):
        t = a[name]
        _require(isinstance(t, torch.Tensor), f"{name}: missing")
        _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(a["rms_gamma"].dtype == x.dtype, "rms_gamma dtype != input dtype (the kernel reinterprets it)")
    _require(a["residual_in"].shape == x.shape and a["residual_out"].shape == x.shape, "residual shapes")
    if has_norm:
        _require(
            isinstance(a["norm_out"], torch.Tensor) and a["norm_out"].shape == x.shape, "norm_out missing"
        )
    if fmt is not None:
        _require(
            isinstance(a["quant_out"], torch.Tensor) and a["quant_out"].is_contiguous(), "quant_out missing"
        )
    if fmt in ("fp8_per_token", "nvfp4", "mxfp8"):
        _require(isinstance(a["scale_out"], torch.Tensor), "scale_out missing")
    if fmt in ("fp8_static", "nvfp4"):
        sf = a["scale_factor"]
        _require(isinstance(sf, torch.Tensor), "scale_factor: not a tensor (not CUDA-graph safe)")
        _require(sf.dtype == torch.float32 and tuple(sf.shape) == (1,), "scale_factor: needs fp32 [1]")
    _require(
        isinstance(a["use_oneshot"], bool), f"use_oneshot: {a['use_oneshot']!r} (needs an explicit bool)"
    )
    tokens, hidden = x.shape
    if not a["use_oneshot"]:
        _require(tokens > ws.world_size, "sequence length should be larger than tp_size")
    _require(ws.is_buffer_size_sufficient(ws.world_size, tokens, hidden, x.dtype), "workspace too small")


def P_for(state: FakeState) -> Any:
    names = dict(vars(P))
    if tuple(int(v) for v in state.version.split(".")[:3]) < (0, 7, 4):
        names.pop("kARResidualRMSNormMXFP8Quant")
        names.pop("kARResidualRMSNormOutMXFP8Quant")
    return type("AllReduceFusionPattern", (), names)


class _Modules:
    """The fake module tree for one ``FakeState``."""

    def __init__(self, state: FakeState, *, old_api: bool = False) -> None:
        self.state = state
        fi = types.ModuleType("flashinfer")
        fi.__version__ = state.version
        fi.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None, is_package=True)
        fi.__path__ = []
        comm = types.ModuleType("flashinfer.comm")
        comm.__spec__ = importlib.machinery.ModuleSpec("flashinfer.comm", None, is_package=True)
        comm.__path__ = []
        comm.AllReduceFusionPattern = P_for(state)
        comm.QuantizationSFLayout = type(
            "QuantizationSFLayout", (), {"SWIZZLED_128x4": 0, "SWIZZLED_8x4": 1, "LINEAR": 2}
        )

        @functools.wraps(_create_signature)
        def create_allreduce_fusion_workspace(*args: Any, **kwargs: Any) -> FakeWorkspace:
            state.creates.append(dict(kwargs, _positional=args))
            state.events.append(f"create:{kwargs.get('backend')}")
            if state.fail_create:
                raise RuntimeError(state.fail_create)
            ws = FakeWorkspace(state, _bound(_create_signature, args, kwargs))
            state.workspaces.append(ws)
            return ws

        @functools.wraps(_fusion_signature)
        def allreduce_fusion(*args: Any, **kwargs: Any) -> torch.Tensor:
            state.calls.append(dict(kwargs, _positional=args))
            a = _bound(_fusion_signature, args, kwargs)
            _check_fusion(a, state)
            _compute(a, a["workspace"])
            return a["norm_out"] if a["norm_out"] is not None else a["quant_out"]

        if old_api:  # 0.6-era: no group= and no weight_bias=

            def create_old(
                backend="auto", world_size=None, rank=None, max_token_num=None, hidden_dim=None, dtype=None
            ):
                raise AssertionError("old API must not be called")

            comm.create_allreduce_fusion_workspace = create_old
        else:
            comm.create_allreduce_fusion_workspace = create_allreduce_fusion_workspace
        comm.allreduce_fusion = allreduce_fusion
        mnnvl = types.ModuleType("flashinfer.comm.mnnvl")
        mnnvl.TorchDistBackend = TorchDistBackend
        mnnvl.is_multicast_supported = lambda device_idx: state.multicast
        trtllm_ar = types.ModuleType("flashinfer.comm.trtllm_ar")
        trtllm_ar.get_trtllm_comm_module = functools.partial(self._build, "trtllm")
        trtllm_ar.trtllm_destroy_ipc_workspace_for_all_reduce_fusion = lambda ws, group=None: (
            state.module_refs.pop(id(ws), None)
        )
        mnnvl_ar = types.ModuleType("flashinfer.comm.trtllm_mnnvl_ar")
        mnnvl_ar.get_trtllm_mnnvl_comm_module = functools.partial(self._build, "mnnvl")
        utils = types.ModuleType("flashinfer.utils")
        utils.is_confidential_compute = lambda: state.confidential
        fi.comm, fi.utils = comm, utils
        comm.mnnvl, comm.trtllm_ar, comm.trtllm_mnnvl_ar = mnnvl, trtllm_ar, mnnvl_ar
        self.modules = {
            "flashinfer": fi,
            "flashinfer.comm": comm,
            "flashinfer.comm.mnnvl": mnnvl,
            "flashinfer.comm.trtllm_ar": trtllm_ar,
            "flashinfer.comm.trtllm_mnnvl_ar": mnnvl_ar,
            "flashinfer.utils": utils,
        }

    def _build(self, kind: str) -> object:
        self.state.builds.append(kind)
        self.state.events.append(f"build:{kind}")
        if self.state.fail_build:
            raise RuntimeError(self.state.fail_build)
        return object()


def install(monkeypatch: Any = None, *, old_api: bool = False, **knobs: Any) -> FakeState:
    """Install a fresh fake into ``sys.modules`` (restored by ``monkeypatch`` when given)."""
    state = FakeState(**knobs)
    tree = _Modules(state, old_api=old_api)
    for name, module in tree.modules.items():
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, module)
        else:
            sys.modules[name] = module
    return state


def reset_workspaces() -> None:
    """Forget every shared workspace of ``arnorm_flashinfer`` (between tests)."""
    from arnorm_flashinfer import _workspace

    with _workspace._lock:
        _workspace._cache.clear()
        _workspace._live.clear()
        _workspace._serials.clear()


@pytest.fixture(name="fake_fi")
def fake_fi_fixture(monkeypatch):
    """A fresh fake flashinfer, and no workspace left over from another test."""
    reset_workspaces()
    state = install(monkeypatch)
    yield state
    reset_workspaces()


# -- a Comm stand-in for one process playing rank ``rank`` of ``world_size`` ---------------------


class FakeGroup:
    def __init__(self, name: str) -> None:
        self.group_name = name


class FakeComm:
    """What ``create`` uses of ``arnorm.Comm``; the other ranks' facts are copies of this one's,
    passed through ``peer(facts, rank)`` when given (to make one rank differ)."""

    def __init__(self, world_size: int = 2, rank: int = 0, *, peer: Any = None, name: str = "tp") -> None:
        self.world_size = world_size
        self.rank = rank
        self.device = torch.device("cpu")
        self.group = FakeGroup(name) if world_size > 1 else None
        self.cpu_group = FakeGroup(name + "-cpu") if world_size > 1 else None
        self.peer = peer
        self.gathers: list[list[Any]] = []

    def gather_objects(self, obj: Any) -> list[Any]:
        # ``peer`` rewrites the facts round; the JIT-build round (None or a message) is echoed.
        import dataclasses

        rewrite = self.peer is not None and dataclasses.is_dataclass(obj)
        out = [self.peer(obj, r) if rewrite and r != self.rank else obj for r in range(self.world_size)]
        self.gathers.append(out)
        return out


def make_problem(**overrides: Any) -> Any:
    from arnorm._problem import Problem

    fields = {
        "world_size": 2,
        "hidden_size": 64,
        "dtype": "bfloat16",
        "eps": 1e-6,
        "weight_offset": 0.0,
        "quant": None,
        "scale_layout": None,
        "max_tokens": 64,
        "normed_output": True,
        "inplace": True,
        "device_type": "cuda",
        "platform": "cuda",
        "arch": (9, 0),
    }
    fields.update(overrides)
    if fields["quant"] == "nvfp4" and "scale_layout" not in overrides:
        fields["scale_layout"] = "swizzled_128x4"
    if fields["quant"] == "mxfp8" and "scale_layout" not in overrides:
        fields["scale_layout"] = "linear"
    return Problem(**fields)
