"""The ops the vLLM entry points run on: built lazily, one per configuration, shared by every layer.

The settings :func:`arnorm.integrations.vllm.configure` sets, the cache of ops, and where the TP
group comes from (configure(), or vLLM's parallel state looked up at each call).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from arnorm._errors import InvalidInputError, NoEligibleBackendError
from arnorm._types import LOCAL, RMSNorm
from arnorm.integrations._vllm_groups import Tp, explicit_tp, vllm_coordinator, vllm_tp
from arnorm.op._op import AllReduceNorm

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "IN_CAPTURE",
    "close",
    "entry",
    "local_tp",
    "lock",
    "ops",
    "settings",
    "tally",
    "tp",
]

#: Token budget of the ops when neither configure() nor vLLM's scheduler says otherwise.
DEFAULT_MAX_TOKENS = 8192


@dataclass
class _Settings:
    group: Any = None  # None: vLLM's
    cpu_group: Any = None
    max_tokens: int | None = None
    backend: str | Sequence[str] | None = None
    explicit: Tp | None = None
    from_vllm: Tp | None = None


@dataclass
class _Entry:
    op: AllReduceNorm | None  # None: the op refused this configuration, for ``refused``
    served: dict[int, str | None] = field(default_factory=dict)
    refused: str | None = None

    def backend(self, num_tokens: int) -> str | None:
        """The fused backend serving ``num_tokens`` (cached per count); None where only the
        reference would, above the budget, or without an op."""
        if num_tokens in self.served:
            return self.served[num_tokens]
        name = None
        if self.op is not None:
            try:
                name = self.op.backend_for(num_tokens)
            except (InvalidInputError, NoEligibleBackendError):  # above the budget, or nothing serves it
                name = None
            if name == "reference":
                name = None
        self.served[num_tokens] = name
        return name

    def serves(self, num_tokens: int) -> bool:
        """A backend other than the reference serves ``num_tokens`` (cached per count)."""
        return self.backend(num_tokens) is not None


settings = _Settings()
ops: dict[tuple[Any, ...], _Entry] = {}
lock = threading.RLock()
#: Calls served in this process: ``(entry point, fused backend name or "unfused")`` -> count.
tally: Counter[tuple[str, str]] = Counter()

#: Why a configuration first seen inside CUDA-graph capture runs unfused (nothing is built there).
IN_CAPTURE = (
    "op: first needed inside CUDA-graph capture (needs building before capture: vLLM's profile run "
    "or arnorm.integrations.vllm.warmup(...); building is collective and cannot be captured)"
)


def close() -> None:
    """Close every op built so far (local; the next call builds them again, collectively)."""
    with lock:
        entries = list(ops.values())
        ops.clear()
    for e in entries:
        if e.op is not None:
            e.op.close()


def tp() -> Tp:
    """The TP group calls run on: configure()'s, else vLLM's (the ops of an earlier vLLM group are
    closed when it changes)."""
    if settings.explicit is not None:
        return settings.explicit
    coordinator = vllm_coordinator()
    cached = settings.from_vllm
    if cached is not None and cached.source is coordinator:
        return cached
    with lock:
        close()  # ops of an earlier vLLM group
        settings.from_vllm = vllm_tp(coordinator)
    return settings.from_vllm


_local: list[Tp] = []


def local_tp() -> Tp:
    """The single-process group the mxfp8 fallback normalizes on after its all-reduce."""
    if not _local:
        _local.append(explicit_tp(LOCAL, None))
    return _local[0]


def entry(
    tp: Tp,
    hidden_states: torch.Tensor,
    norm: RMSNorm,
    quant: str | None,
    layout: str | None,
    normed_output: bool,
    output_layout: str = "separate",
) -> _Entry:
    """The op for this configuration, built now if needed (collective: every TP rank makes the same
    first call), or the reason no op takes it (kept, so not rebuilt)."""
    key = (id(tp), hidden_states.shape[1], hidden_states.dtype, hidden_states.device, norm, quant, layout,
           normed_output, output_layout)  # fmt: skip
    entry = ops.get(key)
    if entry is not None:
        return entry
    if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
        # Every rank captures the same sizes, so every rank takes the unfused path here alike;
        # not kept: the next eager call builds the op.
        return _Entry(None, refused=IN_CAPTURE)
    with lock:
        entry = ops.get(key)
        if entry is None:
            build = {
                "hidden_size": hidden_states.shape[1], "dtype": hidden_states.dtype, "norm": norm,
                "quant": quant, "max_tokens": settings.max_tokens or DEFAULT_MAX_TOKENS,
                "backend": settings.backend, "normed_output": normed_output, "scale_layout": layout,
                "device": hidden_states.device, "cpu_group": tp.cpu_group,
            }  # fmt: skip
            try:
                try:
                    op = AllReduceNorm(tp.group, output_layout=output_layout, **build)
                except NoEligibleBackendError:
                    if output_layout == "separate":
                        raise
                    # No backend here writes the in-place layout (every rank raised alike): the
                    # default layout, which the caller reads the same way.
                    op = AllReduceNorm(tp.group, **build)
            except InvalidInputError as exc:
                # A configuration no op takes (a hidden size the format cannot split): raised on
                # every rank alike, so every rank takes the unfused path; kept, so not rebuilt.
                entry = ops[key] = _Entry(None, refused=str(exc))
            else:
                entry = ops[key] = _Entry(op)
    return entry
