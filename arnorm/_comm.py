"""``Comm``: the TP group an op runs on, plus the CPU group used for agreement.

Agreement (eligibility, setup success) always travels over a gloo group so it works before any
device communicator exists and never touches the GPU stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = ["Comm"]

# new_group is collective over WORLD: create the gloo twin of a group once per rank list and reuse it.
_CPU_GROUPS: dict[tuple[int, ...], Any] = {}


class Comm:
    """The ranks one op spans.

    ``group`` is ``None`` for a single process (no collective at all); ``cpu_group`` is a gloo
    group over the same ranks (the group itself when it already is gloo). ``device`` is the
    ``torch.device`` the op's tensors live on.
    """

    __slots__ = ("cpu_group", "device", "group", "rank", "world_size")

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        cpu_group: dist.ProcessGroup | None = None,
    ) -> None:
        import torch.distributed as dist

        self.group = group
        self.device = device
        if group is None:
            self.rank, self.world_size, self.cpu_group = 0, 1, None
            return
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.cpu_group = cpu_group if cpu_group is not None else _gloo_twin(group)

    @classmethod
    def resolve(
        cls,
        group: dist.ProcessGroup | None,
        device: torch.device,
        cpu_group: dist.ProcessGroup | None = None,
    ) -> Comm:
        """``group=None``: WORLD when torch.distributed is initialized, else a single process."""
        import torch.distributed as dist

        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is not None and dist.get_world_size(group) == 1:
            return cls(None, device)
        return cls(group, device, cpu_group)

    @property
    def backend_name(self) -> str:
        """The torch.distributed backend of ``group`` (``"none"`` for a single process)."""
        import torch.distributed as dist

        return "none" if self.group is None else str(dist.get_backend(self.group))

    # -- agreement over the CPU group -------------------------------------------------------

    def gather_objects(self, obj: object) -> list[Any]:
        """Every rank's ``obj``, in rank order (a single process gets ``[obj]``)."""
        import torch.distributed as dist

        if self.cpu_group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Element-wise AND of ``flags`` over the ranks (every rank passes the same length)."""
        import torch
        import torch.distributed as dist

        if self.cpu_group is None or not flags:
            return list(flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [bool(v) for v in t.tolist()]

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
        gather(out.view(-1, *tensor.shape[1:]), tensor, group=self.group)
        return out

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        import torch.distributed as dist

        if self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def barrier(self) -> None:
        """Wait for every rank (over the CPU group)."""
        import torch.distributed as dist

        if self.cpu_group is not None:
            dist.barrier(group=self.cpu_group)


def _gloo_twin(group: dist.ProcessGroup) -> dist.ProcessGroup:
    import torch.distributed as dist

    if str(dist.get_backend(group)) == "gloo":
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    twin = _CPU_GROUPS.get(ranks)
    if twin is None:
        # Collective over WORLD: every rank of WORLD constructs its ops in the same order, as
        # torch requires for new_group; pass cpu_group= to AllReduceNorm to avoid it.
        twin = dist.new_group(list(ranks), backend="gloo")
        _CPU_GROUPS[ranks] = twin
    return twin
