"""Where the vLLM entry points' TP group comes from: configure(), or vLLM's own parallel state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from arnorm._errors import InvalidInputError
from arnorm._types import LOCAL

__all__ = ["VLLM_STATE", "Tp", "agree_routing", "explicit_tp", "vllm_coordinator", "vllm_tp"]

#: ``[vllm.distributed.parallel_state]``, or ``[None]`` once vllm was found not importable.
VLLM_STATE: list[Any] = []


@dataclass
class Tp:
    """The TP group calls run on, and how the unfused path all-reduces over it."""

    group: Any  # a ProcessGroup, or arnorm.LOCAL
    cpu_group: Any
    world_size: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    source: Any = None  # vLLM's GroupCoordinator this came from, if any


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def explicit_tp(group: Any, cpu_group: Any) -> Tp:
    """The group configure() named: ``arnorm.LOCAL``, or a ProcessGroup reduced with torch.distributed."""
    import torch.distributed as dist

    if group is LOCAL or dist.get_world_size(group) == 1:
        return Tp(LOCAL, None, 1, _identity)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return Tp(group, cpu_group, dist.get_world_size(group), all_reduce)


def _parallel_state() -> Any:
    if not VLLM_STATE:
        try:
            from vllm.distributed import parallel_state
        except ImportError:
            parallel_state = None
        VLLM_STATE.append(parallel_state)
    return VLLM_STATE[0]


def vllm_coordinator() -> Any:
    """vLLM's TP ``GroupCoordinator`` (looked up at each call: cheap); raises when there is none."""
    state = _parallel_state()
    if state is None:
        raise InvalidInputError(
            "group: none configured and vllm is not importable (needs "
            "arnorm.integrations.vllm.configure(group=...), or vLLM's parallel state)"
        )
    try:
        coordinator = state.get_tp_group()
    except AssertionError:  # vLLM asserts its groups exist
        coordinator = None
    if coordinator is None:
        raise InvalidInputError(
            "group: vLLM's tensor-parallel group is not initialized (needs vLLM's "
            "initialize_model_parallel first, or arnorm.integrations.vllm.configure(group=...))"
        )
    return coordinator


def vllm_tp(coordinator: Any) -> Tp:
    """vLLM's device group for the data, its CPU group for agreement, its all_reduce for the unfused path."""
    size = int(coordinator.world_size)
    if size == 1:
        return Tp(LOCAL, None, 1, _identity, coordinator)
    return Tp(coordinator.device_group, coordinator.cpu_group, size, coordinator.all_reduce, coordinator)


def agree_routing(coordinator: Any, routed: bool) -> None:
    """Check, at the first call on vLLM's TP group, that every TP rank made the same choice: vLLM's
    fused helpers routed to arnorm (``routed``), or left to vLLM (``ARNORM_VLLM=0``). Ranks that
    differ would pair arnorm's agreement with vLLM's all-reduce and hang; here every rank raises the
    same :class:`arnorm.InvalidInputError` instead. Through the store, bounded by ``peer_timeout``
    (:class:`arnorm.PeerError` for a rank that never makes the call); nothing at TP 1."""
    if int(coordinator.world_size) == 1:
        return
    import torch.distributed as dist

    from arnorm.comm._rendezvous import Channel, default_store, ranks_text

    store = default_store()
    if store is None:
        return
    from arnorm._config import DEFAULT_PEER_TIMEOUT, Config

    try:
        timeout = Config().peer_timeout
    except Exception:  # a malformed ARNORM_* value: said by the op's own agreement
        timeout = DEFAULT_PEER_TIMEOUT
    group = coordinator.cpu_group
    ranks = tuple(dist.get_process_group_ranks(group))
    channel = Channel(store, ranks, dist.get_rank(group), timeout, namespace="arnorm-vllm")
    channel.what, channel.phase = "the routing check of vLLM's helpers", "making"
    seen = channel.gather(bool(routed))
    channel.done()
    if len(set(seen)) > 1:
        detail = "; ".join(
            f"{ranks_text([r], ranks)}: {'routed to arnorm' if s else 'left to vLLM (ARNORM_VLLM=0)'}"
            for r, s in enumerate(seen)
        )
        raise InvalidInputError(
            f"ARNORM_VLLM: differs across the TP ranks ({detail}) (needs the same value on every rank: "
            "ranks running arnorm's fused helpers and ranks running vLLM's would wait on different "
            "collectives)"
        )
