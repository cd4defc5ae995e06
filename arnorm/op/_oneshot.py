"""``fused_allreduce_norm``: the one-call form of :class:`AllReduceNorm`, with its ops cached."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from arnorm._errors import InvalidInputError
from arnorm._problem import DTYPES
from arnorm._types import Output, RMSNorm
from arnorm.op._op import AllReduceNorm
from arnorm.registry._capabilities import join_or

if TYPE_CHECKING:
    import torch

__all__ = ["CACHE_SIZE", "fused_allreduce_norm"]

#: Ops ``fused_allreduce_norm`` keeps (least recently used first out; an evicted op is closed).
CACHE_SIZE = 16

_cache: OrderedDict[tuple[Any, ...], AllReduceNorm] = OrderedDict()
_cache_lock = threading.Lock()


def fused_allreduce_norm(
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    group: Any,
    eps: float,
    weight_offset: float = 0.0,
    round_before_weight: bool = False,
    normalize_unrounded: bool = False,
    quant: str | None = None,
    scale: torch.Tensor | None = None,
    inplace: bool = True,
) -> Output:
    """One-shot form of :class:`AllReduceNorm`, with the op cached per signature.

    ``group`` is required: a ``ProcessGroup`` or :data:`arnorm.LOCAL`. The first call for a
    signature (group, hidden size, dtype, device, eps, offset, rounding order, which sum the norm
    reads (``normalize_unrounded``, see :class:`arnorm.RMSNorm`), quant, inplace, and
    whether ``residual`` is ``None``: an op with ``add_residual=False``) builds
    an op (collective); a call with more tokens than the cached op's budget builds a larger one.
    At most :data:`CACHE_SIZE` ops are kept; the least recently used is closed when another is
    needed (identically on every rank, when every rank makes the same calls). Engines should keep
    an ``AllReduceNorm`` instead: this helper costs a lock and a dictionary lookup more per call.
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
    norm = RMSNorm(eps, weight_offset, round_before_weight, normalize_unrounded)
    add_residual = residual is not None
    key = (group, h, hidden_states.dtype, hidden_states.device, norm, quant, inplace, add_residual)
    with _cache_lock:
        op = _cache.get(key)
        if op is None or op._closed or t > op._max_tokens:
            if op is not None:
                op.close()
                del _cache[key]
            budget = max(8192, 1 << (int(t) - 1).bit_length())
            op = AllReduceNorm(group, hidden_size=h, dtype=hidden_states.dtype, norm=norm, quant=quant,
                               max_tokens=budget, inplace=inplace, device=hidden_states.device,
                               add_residual=add_residual)  # fmt: skip
            _cache[key] = op
            while len(_cache) > CACHE_SIZE:
                _, evicted = _cache.popitem(last=False)
                evicted.close()
        else:
            _cache.move_to_end(key)
    return op(hidden_states, residual, weight, scale)
