"""``Comm``: the TP group an op runs on, plus the CPU group used for agreement.

Agreement (arguments, eligibility, setup success) always travels over a gloo group, so it works
before any device communicator exists and never touches the GPU stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arnorm._errors import InvalidInputError
from arnorm._types import LOCAL

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = ["Comm"]

# new_group is collective over WORLD: create the gloo twin of WORLD once and reuse it.
_CPU_GROUPS: dict[tuple[int, ...], Any] = {}

_GROUP_NEEDS = (
    "needs a torch.distributed ProcessGroup of the TP ranks, or arnorm.LOCAL for a single process; "
    "pass torch.distributed.group.WORLD to mean every rank"
)


def _none_group_message() -> str:
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        # torch.distributed.group.WORLD reads None until init_process_group: name the real cause.
        return (
            "tp_group: None, and torch.distributed is not initialized (torch.distributed.group.WORLD "
            "is None until then) (needs torch.distributed.init_process_group() on every rank before "
            "the op is built, or arnorm.LOCAL for a single process)"
        )
    return f"tp_group: None ({_GROUP_NEEDS})"


def _not_a_group_message(tp_group: object) -> str:
    kind = type(tp_group).__name__
    if hasattr(tp_group, "device_group") and hasattr(tp_group, "cpu_group"):
        # An engine's coordinator (vLLM's GroupCoordinator) wraps the two groups arnorm needs.
        return (
            f"tp_group: {kind}, a group coordinator, not a ProcessGroup (needs its two groups: "
            "tp_group=<it>.device_group, cpu_group=<it>.cpu_group)"
        )
    return f"tp_group: {kind} {tp_group!r} ({_GROUP_NEEDS})"


def _supports_cpu(group: Any) -> bool:
    import torch.distributed as dist

    return "gloo" in str(dist.get_backend(group))


class Comm:
    """The ranks one op spans, as backends see them.

    - ``group``: the TP ``ProcessGroup`` (``None`` at world size 1: no collective at all).
    - ``cpu_group``: a gloo group over the same ranks, for agreement (``None`` at world size 1).
    - ``rank``, ``world_size``: this process's rank in ``group`` and its size.
    - ``device``: the ``torch.device`` the op's tensors live on.
    """

    __slots__ = ("cpu_group", "device", "group", "rank", "world_size")

    def __init__(self, group: Any, device: torch.device, cpu_group: Any = None) -> None:
        self.group = group
        self.device = device
        self.cpu_group = cpu_group
        if group is None:
            self.rank, self.world_size = 0, 1
            return
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if cpu_group is None:
            # Agreement without a CPU group would silently agree with this rank alone.
            if not _supports_cpu(group):
                msg = "cpu_group: None (needs a gloo group over the device group's ranks; see Comm.resolve)"
                raise InvalidInputError(msg)
            self.cpu_group = group

    @classmethod
    def resolve(cls, tp_group: object, device: torch.device, cpu_group: object = None) -> Comm:
        """Check the groups an op was given and pair the TP group with its CPU twin.

        ``arnorm.LOCAL`` (or a group of one rank) is a single process. A gloo TP group is its own
        CPU group. A device group that spans WORLD gets a gloo twin over WORLD (created once;
        collective over WORLD, whose every rank is in it). A smaller device group needs
        ``cpu_group``: creating one would be collective over WORLD and hang engines whose ranks
        sit in different TP groups.
        """
        import torch.distributed as dist

        if tp_group is LOCAL:
            return cls(None, device)
        if tp_group is None:
            raise InvalidInputError(_none_group_message())
        if dist.is_available() and tp_group is dist.GroupMember.NON_GROUP_MEMBER:
            # What new_group() returns on ranks outside the group.
            raise InvalidInputError(
                f"tp_group: does not include this process (global rank {dist.get_rank()}) "
                "(needs the TP group this rank belongs to)"
            )
        if not (dist.is_available() and isinstance(tp_group, dist.ProcessGroup)):
            raise InvalidInputError(_not_a_group_message(tp_group))
        if dist.get_rank(tp_group) < 0:
            raise InvalidInputError(
                f"tp_group: does not include this process (global rank {dist.get_rank()}) "
                "(needs the TP group this rank belongs to)"
            )
        if dist.get_world_size(tp_group) == 1:
            return cls(None, device)
        return cls(tp_group, device, _cpu_twin(tp_group, cpu_group))

    # -- agreement over the CPU group -------------------------------------------------------

    def gather_objects(self, obj: object) -> list[Any]:
        """Every rank's ``obj``, in rank order (a single process gets ``[obj]``)."""
        import torch.distributed as dist

        if self.cpu_group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    # -- data collectives on the device group -----------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order."""
        import torch
        import torch.distributed as dist

        if self.group is None:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return parts

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Gather ``tensor`` ``[T, ...]`` from every rank into ``out``, rank after rank.

        ``out`` holds ``world_size * T`` rows: ``[world_size, T, ...]`` or ``[world_size * T, ...]``
        (it is passed on flattened, the one shape gloo and NCCL both accept).
        """
        import torch.distributed as dist

        if self.group is None:
            out.view(tensor.shape).copy_(tensor)
            return out
        # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1, *tensor.shape[1:]), tensor.contiguous(), group=self.group)
        return out

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        import torch.distributed as dist

        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor


def _cpu_twin(group: dist.ProcessGroup, cpu_group: object) -> Any:
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    if cpu_group is not None:
        if cpu_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise InvalidInputError(
                "cpu_group: does not include this process (needs a gloo group over the ranks of tp_group)"
            )
        if not isinstance(cpu_group, dist.ProcessGroup):
            raise InvalidInputError(
                f"cpu_group: {type(cpu_group).__name__} (needs a gloo ProcessGroup over the TP ranks)"
            )
        cpu_ranks = tuple(dist.get_process_group_ranks(cpu_group))
        if cpu_ranks != ranks:
            msg = f"cpu_group: ranks {list(cpu_ranks)} (needs {list(ranks)}, the ranks of tp_group, in order)"
            raise InvalidInputError(msg)
        if not _supports_cpu(cpu_group):
            found = dist.get_backend(cpu_group)
            msg = f"cpu_group: backend {found} (needs gloo: agreement runs on CPU tensors)"
            raise InvalidInputError(msg)
        return cpu_group
    if _supports_cpu(group):
        return group
    if len(ranks) != dist.get_world_size():
        raise InvalidInputError(
            f"cpu_group: missing for a {dist.get_backend(group)} group of {len(ranks)} of "
            f"{dist.get_world_size()} ranks (needs cpu_group=, a gloo group over the same ranks, e.g. the "
            "engine's TP CPU group: arnorm will not create one, which is collective over WORLD)"
        )
    twin = _CPU_GROUPS.get(ranks)
    if twin is None:
        twin = dist.new_group(list(ranks), backend="gloo")
        _CPU_GROUPS[ranks] = twin
    return twin
