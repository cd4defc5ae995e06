"""``AllReduceNorm``: the object engines keep per layer, and ``fused_allreduce_norm`` on top of it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arnorm._comm import Comm
from arnorm._config import Config, load_config
from arnorm._custom_op import call_custom_op, register_handle, unregister_handle
from arnorm._discovery import get_registry
from arnorm._errors import InvalidInputError, NoEligibleBackendError
from arnorm._explain import Explanation
from arnorm._problem import DTYPES, Problem
from arnorm._select import Preference, select
from arnorm._types import Output, RMSNorm
from arnorm._validate import check_call, needs_scale

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = ["AllReduceNorm", "fused_allreduce_norm"]


def _platform(device: torch.device) -> tuple[str, tuple[int, int] | None, str | None]:
    import torch

    if device.type != "cuda":
        return device.type, None, None
    if torch.version.hip:
        gfx = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return "rocm", None, gfx
    return "cuda", tuple(torch.cuda.get_device_capability(device)), None  # type: ignore[return-value]


def _check_static_args(
    hidden_size: object, dtype: object, norm: object, max_tokens: object, flags: dict
) -> str:
    import torch

    if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
        raise InvalidInputError(f"hidden_size: {hidden_size!r} (needs a positive int)")
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None
    if name not in DTYPES:
        raise InvalidInputError(f"dtype: {dtype!r} (needs torch.bfloat16, torch.float16 or torch.float32)")
    if not isinstance(norm, RMSNorm):
        raise InvalidInputError(
            f"norm: {type(norm).__name__} (needs arnorm.RMSNorm(eps=..., weight_offset=...))"
        )
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidInputError(f"max_tokens: {max_tokens!r} (needs a positive int)")
    for arg, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidInputError(f"{arg}: {value!r} (needs True or False)")
    return name


class AllReduceNorm:
    """Fused all-reduce + residual add + RMSNorm (+ quantization) over a tensor-parallel group.

    For this rank's partial sum ``x_r`` ``[T, H]``, with ``D`` the op's dtype::

        residual_out = D(D(sum_r fp32(x_r)) + residual)                         # -> Output.residual
        normed       = D(residual_out * rsqrt(mean(residual_out**2) + eps) * (weight_offset + weight))
        quant        = Q(normed)                                                # -> Output.quant

    Construction is collective and does everything slow (discovery, probing, cross-rank agreement,
    workspace creation) so that a call does no host sync, no discovery and no allocation beyond
    its outputs. Every rank of ``group`` must build the op with the same arguments.

    Args:
        group: the TP ``ProcessGroup``; ``None`` means WORLD when torch.distributed is initialized,
            else a single process (size 1: no all-reduce).
        hidden_size: ``H``.
        dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        norm: :class:`arnorm.RMSNorm` (``weight_offset=1.0`` for Gemma).
        quant: ``None`` or ``"fp8_static"``, ``"fp8_per_token"``, ``"nvfp4"``, ``"mxfp8"``.
        max_tokens: the largest ``T`` a call may pass; sizes workspaces.
        backend: ``None`` for auto, or a name / ordered list of names (strict: no fallback).
        normed_output: also return the normed activation in ``dtype``.
        inplace: write the new residual into ``hidden_states``' buffer.
        scale_layout: nvfp4 / mxfp8 block-scale layout (defaults: ``swizzled_128x4`` / ``linear``).
        device: where the tensors live (default: the current CUDA device, else CPU).
        cpu_group: a gloo group over the same ranks for agreement (default: ``group`` if it is
            gloo, else one created with ``new_group``, which is collective over WORLD).
        config: :class:`arnorm.Config`; default reads the ``ARNORM_*`` environment.

    Raises:
        InvalidInputError: bad arguments, or ranks that disagree on them.
        NoEligibleBackendError: no backend can serve the problem on every rank.
        BackendNotInstalledError, BackendBrokenError, BackendSetupError: a named backend cannot serve.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        hidden_size: int = 0,
        dtype: torch.dtype | None = None,
        norm: RMSNorm | None = None,
        quant: str | None = None,
        max_tokens: int = 8192,
        backend: str | Sequence[str] | None = None,
        normed_output: bool = True,
        inplace: bool = True,
        *,
        scale_layout: str | None = None,
        device: torch.device | str | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        config: Config | None = None,
    ) -> None:
        import torch

        self._closed = True  # until construction succeeds, so close() and __del__ paths are safe
        self._chain: list[Any] = []
        self._by_tokens: dict[int, Any] = {}
        norm = RMSNorm() if norm is None else norm
        flags = {"normed_output": normed_output, "inplace": inplace}
        dtype_name = _check_static_args(hidden_size, dtype, norm, max_tokens, flags)
        layout = None
        if quant is not None:
            from arnorm.quant import check_format

            layout = check_format(quant, scale_layout, hidden_size)
        elif scale_layout is not None:
            raise InvalidInputError(f"scale_layout: {scale_layout!r} (needs None when quant is None)")
        if not normed_output and quant is None:
            raise InvalidInputError(
                "normed_output: False with quant=None (needs normed_output=True or a quant format)"
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        config = load_config() if config is None else config
        comm = Comm.resolve(group, device, cpu_group)
        platform, arch, gfx = _platform(device)
        self._problem = Problem(
            world_size=comm.world_size,
            hidden_size=hidden_size,
            dtype=dtype_name,
            eps=float(norm.eps),
            weight_offset=float(norm.weight_offset),
            quant=quant,
            scale_layout=layout,
            max_tokens=max_tokens,
            normed_output=normed_output,
            inplace=inplace,
            device_type=device.type,
            platform=platform,
            arch=arch,
            gfx_arch=gfx,
        )
        self._explanation, self._chain = select(
            self._problem, comm, config, Preference.resolve(backend, config), get_registry()
        )
        self._comm = comm
        self._device = device
        # Hot-path constants: attribute lookups on self are the whole cost of a valid call.
        self._dtype: torch.dtype = getattr(torch, dtype_name)
        self._dev_index = -1 if device.type == "cpu" else device.index
        self._hidden = hidden_size
        self._wshape = torch.Size([hidden_size])
        self._max_tokens = max_tokens
        self._needs_scale = needs_scale(quant)
        self._weight_seen: Any = None
        self._scale_seen: Any = None
        self._f32 = torch.float32
        self._is_compiling = torch.compiler.is_compiling
        self._handle = register_handle(self)
        self._closed = False

    # -- calls ------------------------------------------------------------------------------

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
    ) -> Output:
        """Run one fused step; see the class docstring for the formula.

        Args:
            hidden_states: ``[T, H]`` this rank's partial sum (becomes the new residual when the
                op is in place).
            residual: ``[T, H]``, not modified.
            weight: ``[H]`` norm weight in the op's dtype (raw Gemma weight; the offset is added).
            scale: fp32 ``[1]`` on the op's device: the dequant scale (fp8_static) or the global
                encode scale (nvfp4); ``None`` for the other formats.
        """
        if self._is_compiling():
            return call_custom_op(self, self._handle, hidden_states, residual, weight, scale)
        # One frame and one combined condition: a valid call pays ~15 attribute reads and nothing else;
        # check_call builds the precise message only when something is off.
        try:
            shape = hidden_states.shape
            dt = self._dtype
            dev = self._dev_index
            ok = (
                hidden_states.dtype is dt
                and residual.dtype is dt
                and len(shape) == 2
                and shape[1] == self._hidden
                and 0 < shape[0] <= self._max_tokens
                and residual.shape == shape
                and hidden_states.is_contiguous()
                and residual.is_contiguous()
                and hidden_states.get_device() == dev
                and residual.get_device() == dev
                and residual is not hidden_states
                and (weight is self._weight_seen or self._weight_fits(weight))
                and (
                    (scale is self._scale_seen or self._scale_fits(scale))
                    if self._needs_scale
                    else scale is None
                )
            )
        except (AttributeError, TypeError):
            ok = False
        if not ok:
            check_call(self._problem, self._dtype, self._device, hidden_states, residual, weight, scale)
        impl = self._by_tokens.get(shape[0])
        if impl is None:
            impl = self._dispatch(shape[0])
        return impl(hidden_states, residual, weight, scale)

    def _weight_fits(self, weight: Any) -> bool:
        # The weight is the same tensor step after step: check it once, then trust its identity
        # (its dtype, shape and device change only through .data / .set_(), which engines don't do).
        fits = bool(
            weight.dtype is self._dtype
            and weight.shape == self._wshape
            and weight.is_contiguous()
            and weight.get_device() == self._dev_index
        )
        if fits:
            self._weight_seen = weight
        return fits

    def _scale_fits(self, scale: Any) -> bool:
        # Static scales are one tensor per layer too: checked once, then trusted by identity.
        fits = bool(
            scale is not None
            and scale.dtype is self._f32
            and scale.shape == (1,)
            and scale.get_device() == self._dev_index
        )
        if fits:
            self._scale_seen = scale
        return fits

    def _dispatch(self, num_tokens: int) -> Any:
        if self._closed:
            raise InvalidInputError("op: closed (needs a new arnorm.AllReduceNorm)")
        skipped = []
        for name, impl in zip(self._explanation.chain, self._chain, strict=True):
            reasons = tuple(impl.check_tokens(num_tokens))
            if not reasons:
                self._by_tokens[num_tokens] = impl
                return impl
            skipped.append(f"{name}: " + "; ".join(reasons))
        msg = f"tokens: {num_tokens} (no backend of this op serves it: {' | '.join(skipped)})"
        raise NoEligibleBackendError(msg)

    def _check_tokens_arg(self, num_tokens: object) -> int:
        if not isinstance(num_tokens, int) or not 0 < num_tokens <= self._max_tokens:
            raise InvalidInputError(f"num_tokens: {num_tokens!r} (needs an int from 1 to {self._max_tokens})")
        return num_tokens

    # -- introspection ----------------------------------------------------------------------

    @property
    def problem(self) -> Problem:
        """The static description this op was built for."""
        return self._problem

    @property
    def backend(self) -> str:
        """The selected backend (the one that serves every token count its budget allows)."""
        return self._explanation.chain[0]

    def backend_for(self, num_tokens: int) -> str:
        """The backend a call with ``num_tokens`` tokens runs on."""
        impl = self._dispatch(self._check_tokens_arg(num_tokens))
        return self._explanation.chain[self._chain.index(impl)]

    def explain(self, num_tokens: int | None = None) -> Explanation:
        """Every backend's verdict; with ``num_tokens``, also which one serves it and why not the others."""
        if num_tokens is None:
            return self._explanation
        t = self._check_tokens_arg(num_tokens)
        skipped = []
        served = None
        for name, impl in zip(self._explanation.chain, self._chain, strict=True):
            reasons = tuple(impl.check_tokens(t))
            if not reasons:
                served = name
                break
            skipped.append((name, reasons))
        return dataclasses.replace(
            self._explanation, num_tokens=t, token_backend=served, token_reasons=tuple(skipped)
        )

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Free the backends' workspaces (collective: every rank calls it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._by_tokens.clear()
        unregister_handle(self._handle)
        chain, self._chain = self._chain, []
        for impl in chain:
            impl.close()

    def __enter__(self) -> AllReduceNorm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "+".join(self._explanation.chain)
        return f"AllReduceNorm({self._problem.short()}, backend={state})"


_cache: dict[tuple[Any, ...], AllReduceNorm] = {}
_cache_lock = threading.Lock()


def fused_allreduce_norm(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    weight_offset: float = 0.0,
    quant: str | None = None,
    scale: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    inplace: bool = True,
) -> Output:
    """One-shot form of :class:`AllReduceNorm`, with the op cached per signature.

    The first call for a signature (group, hidden size, dtype, device, eps, offset, quant,
    inplace) builds an op (collective); a call with more tokens than the cached op's budget builds
    a larger one. Prefer keeping an ``AllReduceNorm`` per layer in an engine: this helper costs a
    dictionary lookup more per call.
    """
    import torch

    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        raise InvalidInputError("hidden_states: needs a 2-D torch.Tensor [tokens, hidden]")
    t, h = hidden_states.shape
    key = (
        id(group),
        h,
        hidden_states.dtype,
        hidden_states.device,
        float(eps),
        float(weight_offset),
        quant,
        inplace,
    )
    with _cache_lock:
        op = _cache.get(key)
        if op is None or op._closed or t > op._max_tokens:
            if op is not None:
                op.close()
            budget = max(8192, 1 << (int(t) - 1).bit_length())
            op = AllReduceNorm(
                group,
                h,
                hidden_states.dtype,
                RMSNorm(eps, weight_offset),
                quant,
                budget,
                inplace=inplace,
                device=hidden_states.device,
            )
            _cache[key] = op
    return op(hidden_states, residual, weight, scale)
