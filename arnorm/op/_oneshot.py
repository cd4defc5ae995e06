"""``fused_allreduce_norm``: the one-call form of :class:`AllReduceNorm`, with its ops cached."""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from arnorm._errors import InvalidInputError
from arnorm._formats import DTYPES
from arnorm._norm import NORM_OPTIONS
from arnorm._types import LOCAL, Output, RMSNorm
from arnorm.op._call import agree_larger_call
from arnorm.op._faults import group_owner, is_destroyed
from arnorm.op._op import AllReduceNorm
from arnorm.registry._capabilities import join_or

if TYPE_CHECKING:
    import torch

__all__ = ["CACHE_SIZE", "fused_allreduce_norm"]

#: Ops ``fused_allreduce_norm`` keeps (least recently used first out; an evicted op is closed).
CACHE_SIZE = 16

_cache: OrderedDict[tuple[Any, ...], AllReduceNorm] = OrderedDict()
_cache_lock = threading.Lock()
_exit_hook: list[Any] = []  # one exit handler, registered with the first cached op


def fused_allreduce_norm(
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    group: Any,
    eps: float,
    weight_offset: float = 0.0,
    quant: str | None = None,
    scale: torch.Tensor | None = None,
    inplace: bool = True,
    output_layout: str = "separate",
    **norm_options: bool,
) -> Output:
    """One-shot form of :class:`AllReduceNorm`, with the op cached per signature.

    ``group`` is required: a ``ProcessGroup`` or :data:`arnorm.LOCAL`. ``norm_options``: the
    options of :class:`arnorm.RMSNorm` by name (``round_before_weight=True``,
    ``normalize_unrounded=True``). The first call for a signature (group, hidden size, dtype,
    device, the norm, quant, inplace, output_layout, and whether ``residual`` is ``None``: an op with
    ``add_residual=False``) builds
    an op (collective); a call with more tokens than the cached op's budget builds a larger one.
    At most :data:`CACHE_SIZE` ops are kept; the least recently used is closed when another is
    needed (identically on every rank, when every rank makes the same calls). Engines should keep
    an ``AllReduceNorm`` instead: this helper costs a lock and a dictionary lookup more per call.

    Threads: calls are serialized by the helper's lock, so on :data:`arnorm.LOCAL` any thread may
    call. On a TP group, calls come from the thread owning the group (README, "Threads"): the one
    that built an op on it, else the main thread, so every rank picks the same thread. With
    ``ARNORM_CHECK_CALLS``, a token count over the cached op's budget is agreed on every rank
    before a larger op is built: on one rank only, it is the same error on every rank. A cached op
    poisoned by a failed call (:class:`arnorm.PeerError`) is rebuilt at the next call.
    """
    import torch

    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        found = (f"shape {list(hidden_states.shape)}" if isinstance(hidden_states, torch.Tensor)
                 else type(hidden_states).__name__)  # fmt: skip
        raise InvalidInputError(f"hidden_states: {found} (needs a 2-D torch.Tensor [tokens, hidden])")
    if str(hidden_states.dtype).removeprefix("torch.") not in DTYPES:
        needs = join_or(f"torch.{d}" for d in DTYPES)
        raise InvalidInputError(f"hidden_states: dtype {hidden_states.dtype} (needs {needs})")
    t, h = hidden_states.shape
    # Checked only when options are passed: the common call pays nothing for the check.
    unknown = sorted(set(norm_options) - set(NORM_OPTIONS)) if norm_options else None
    if unknown:
        raise InvalidInputError(
            f"{unknown[0]}: not an argument (needs an argument of fused_allreduce_norm or a norm "
            f"option: {join_or(NORM_OPTIONS)})"
        )
    norm = RMSNorm(eps, weight_offset, **norm_options)
    add_residual = residual is not None
    key = (group, h, hidden_states.dtype, hidden_states.device, norm, quant, inplace, add_residual,
           output_layout)  # fmt: skip
    with _cache_lock:
        op = _cache.get(key)
        owner = op._state.owner if op is not None else 0
        if owner and owner != threading.get_ident():
            raise _thread_error(owner)
        plan = op._plan if op is not None else None
        if op is None or plan is None or plan.closed or plan.poisoned is not None or t > plan.max_tokens:
            # A poisoned op (a rank's call failed part-way; every rank's op is poisoned at the
            # same step) is replaced by a new one, built on every rank at its next call.
            if plan is None or plan.closed or plan.poisoned is not None:
                _check_first_thread(group)
            elif plan.check_calls:
                # The budget is per rank: a larger count on one rank only would build on that rank
                # while the others call. Agree first, as the call itself would.
                agree_larger_call(op, hidden_states, residual, weight, scale)
            if op is not None:
                op.close()
                del _cache[key]
            budget = max(8192, 1 << (int(t) - 1).bit_length())
            op = AllReduceNorm(group, hidden_size=h, dtype=hidden_states.dtype, norm=norm, quant=quant,
                               max_tokens=budget, inplace=inplace, device=hidden_states.device,
                               add_residual=add_residual, output_layout=output_layout)  # fmt: skip
            if not _exit_hook:
                _exit_hook.append(atexit.register(_drop_destroyed))
            _cache[key] = op
            while len(_cache) > CACHE_SIZE:
                _, evicted = _cache.popitem(last=False)
                evicted.close()
        else:
            _cache.move_to_end(key)
        return op(hidden_states, residual, weight, scale)


def _drop_destroyed() -> None:
    """At interpreter exit, close and forget the ops on destroyed groups: the cache's key would
    keep such a group alive into interpreter shutdown (see ``arnorm.op._faults._close_orphans``)."""
    with _cache_lock:
        gone = [key for key in _cache if key[0] is not LOCAL and is_destroyed(key[0])]
        for key in gone:
            with contextlib.suppress(Exception):  # at exit: a close that fails changes nothing
                _cache.pop(key).close()


def _thread_error(owner: int) -> InvalidInputError:
    names = {t.ident: t.name for t in threading.enumerate()}
    here = threading.current_thread().name
    return InvalidInputError(
        f"fused_allreduce_norm: called from thread {here!r} on a TP group owned by thread "
        f"{names.get(owner, owner)!r} (needs every call on a TP group from one thread, the same on "
        "every rank; keep an AllReduceNorm per thread's group instead)"
    )


def _check_first_thread(group: Any) -> None:
    """The first op on a TP group: built from its owner, else from the main thread only (the first
    thread to call would differ between ranks)."""
    if group is LOCAL or threading.current_thread() is threading.main_thread():
        return
    try:
        import torch.distributed as dist

        if dist.get_world_size(group) == 1:
            return
        owner = group_owner(str(getattr(group, "group_name", id(group))))
    except Exception:  # not a usable group: construction says why
        return
    if owner is None:
        here = threading.current_thread().name
        raise InvalidInputError(
            f"fused_allreduce_norm: called from thread {here!r} on a TP group no thread owns yet "
            "(needs the main thread, or a thread that built an AllReduceNorm on the group first: "
            "the first thread to call could differ between ranks)"
        )
    if owner != threading.get_ident():
        raise _thread_error(owner)
