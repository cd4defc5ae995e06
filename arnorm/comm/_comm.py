"""``Comm``: the TP group an op runs on, plus the channels used for agreement.

Agreement (arguments, eligibility, setup success, ``ARNORM_CHECK_CALLS`` fingerprints) travels
through the process group's store (:mod:`arnorm.comm._rendezvous`), keyed by the op and the step, so it
can never pair with a data collective or another op's agreement; it falls back to the gloo CPU
group where no store is reachable. It works before any device communicator exists and never
touches the GPU stream.

On a gloo TP group (CPU tensors), the op's own data collectives run on a communicator private to
the op (the way NCCL gives each communicator its own failure domain), each after a three-number
header (step, status, element count): a rank whose call failed before its collective sends a
poison header in that slot, so its peers raise :class:`arnorm.PeerError` instead of pairing the
step with the next one, and a size mismatch becomes an error instead of a gloo abort. Every wait
there is bounded by ``Config.peer_timeout``. On a device (NCCL) group the data collectives are
the group's own and carry nothing extra (no host sync per call).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, SupportsIndex

from arnorm._errors import InvalidInputError, PeerError
from arnorm._types import LOCAL

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = ["CLOSED", "CallToken", "Comm"]

#: What a closed op says; the op's dispatch and its comm both raise it.
CLOSED = "op: closed (needs a new arnorm.AllReduceNorm)"

#: Header statuses: a call's collective follows; the sender's op failed; the sender rejected the call.
_OK, _POISON, _SKIP = 0, 1, 2
#: Work objects of poison headers nobody waits for, kept alive with their communicator.
_UNWAITED: list[Any] = []

# new_group is collective over WORLD: create the gloo twin of WORLD once and reuse it, for as long
# as that WORLD lives (weakly keyed: after destroy_process_group the twin goes with it, and a new
# init gets a new one; a twin kept to interpreter exit can abort the process, see Comm.close).
_CPU_GROUPS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()

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

    __slots__ = (
        "_broken", "_data", "_stepped", "calls", "channel", "cpu_group", "device", "group", "mid_step",
        "rank", "world_size",
    )  # fmt: skip

    def __init__(self, group: Any, device: torch.device, cpu_group: Any = None) -> None:
        self.group = group
        self.device = device
        self.cpu_group = cpu_group
        #: The store channel agreement goes through (set by construction), else the CPU group.
        self.channel: Any = None
        #: The op's private gloo communicator for its data collectives (CPU ops on gloo groups).
        self._data: Any = None
        #: Data steps (header exchanges) done; whether the call in progress made one (CallToken).
        self.calls = 0
        self._stepped = False
        self._broken = ""
        #: A step's header is out and its data collective is not (arnorm.comm._steps).
        self.mid_step = False
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
        if self.channel is not None:
            return self.channel.gather(obj)
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    # -- faults ----------------------------------------------------------------------------

    def open_data(self, timeout: float) -> None:
        """Give a CPU op on a gloo group its own communicator, named by its channel (collective)."""
        import torch.distributed as dist

        if self.group is None or self.channel is None or self.device.type != "cpu":
            return
        if not _supports_cpu(self.group):
            return
        from datetime import timedelta

        store = dist.PrefixStore(f"{self.channel.prefix}/data", self.channel.store)
        self._data = dist.ProcessGroupGloo(store, self.rank, self.world_size, timedelta(seconds=timeout))

    def close(self) -> None:
        """Let go of every process group, communicator and store (local: the op is closed; a peer
        still calling it times out). A group kept past ``destroy_process_group`` lives until
        interpreter exit, where a gloo worker still finishing the last collective can abort the process."""
        self._data = self.group = self.cpu_group = self.channel = None
        if not self._broken:
            self._broken = CLOSED

    @property
    def counts_calls(self) -> bool:
        """Whether :attr:`calls` counts the op's calls (its data collectives carry headers)."""
        return self._data is not None

    @property
    def stepped(self) -> bool:
        """Whether the call in progress reached its data collective (its header went out)."""
        return self._stepped

    def call_number(self) -> int:
        """The number of the call in progress: :attr:`calls` once it reached its data collective,
        else the next one."""
        return self.calls if self._stepped else self.calls + 1

    def abort(self, message: str) -> None:
        """This rank's op failed part-way: occupy the step the peers wait in (or will wait in next)
        with a poison header, never waited for, and leave ``message`` in the store for them."""
        if self.channel is not None:
            self.channel.abandon(message)
        if self._data is None or self._broken:
            return
        self._broken = message
        # Mid-step, the peers wait for this step's data: a header there would pair with it, and
        # only the note (read by their polled waits) can tell them.
        if not self.mid_step:
            self._send_unwaited(self.calls + 1, _POISON)

    def skip(self) -> None:
        """This rank rejected a call before its collective: occupy that collective's step with a
        skip header, never waited for (peers that made the call raise; arnorm.comm._steps)."""
        if self._data is None or self._broken:
            return
        self.calls += 1
        self._send_unwaited(self.calls, _SKIP)

    def _send_unwaited(self, step: int, status: int) -> None:
        import torch

        header = torch.tensor([step, status, 0], dtype=torch.int64)
        parts = [torch.empty(3, dtype=torch.int64) for _ in range(self.world_size)]
        # The communicator may already be gone: the peers' waits then end at their timeout.
        with contextlib.suppress(Exception):
            _UNWAITED[:] = [u for u in _UNWAITED if not u[1].is_completed()]  # received: let go
            _UNWAITED.append((self._data, self._data.allgather([parts], [header]), parts, header))

    def _step(self, numel: int) -> None:
        """The header of one data collective: raises PeerError (poison, timeout) or
        InvalidInputError (ranks sending different sizes) before the data moves."""
        import torch

        if self._broken:
            raise PeerError(self._broken)
        self._stepped = True
        self.calls += 1
        header = torch.tensor([self.calls, _OK, numel], dtype=torch.int64)
        parts = [torch.empty(3, dtype=torch.int64) for _ in range(self.world_size)]
        self.mid_step = True  # cleared once the data collective is issued (_issued)
        self._wait(self._data.allgather([parts], [header]), "call")
        seen = [p.tolist() for p in parts]
        for r, (step, status, _) in enumerate(seen):
            if status == _SKIP:
                raise self._fail(
                    f"op out of step on rank {r}: it rejected its call {step} before the collective "
                    "(its error is raised there) while this rank made the call; build a new op (needs "
                    "the same calls on every rank; ARNORM_CHECK_CALLS=1 makes every rank raise the "
                    "rejection itself, with its reason, and keeps the op usable)"
                )
            if status == _POISON:
                note = self.channel.note(r) if self.channel is not None else None
                raise self._fail(
                    note or f"op out of step on {self._who(r)}: its call {step} failed; build a new op"
                )
            if step != self.calls:
                raise self._fail(
                    f"op out of step: {self._who(r)} is at call {step}, this rank at {self.calls} (needs "
                    "every rank to make the same calls of the op; build a new op)"
                )
        sizes = [n for _, _, n in seen]
        if any(n != numel for n in sizes):
            detail = ", ".join(f"{self._who(r)}: {n}" for r, n in enumerate(sizes))
            raise InvalidInputError(
                f"calls: differ across ranks ({detail} elements to exchange) (needs the same call on "
                "every rank; ARNORM_CHECK_CALLS=1 says which argument differs)"
            )

    def _who(self, r: int) -> str:
        """Group rank ``r`` named by its global rank (its group rank in brackets where they differ)."""
        return self.channel.who([r]) if self.channel is not None else f"rank {r}"

    def _fail(self, message: str) -> PeerError:
        self._broken = message
        return PeerError(message)

    def _issued(self, work: Any) -> Any:
        self.mid_step = False
        return work

    def _wait(self, work: Any, what: str) -> None:
        from arnorm.comm._steps import wait_work

        note = wait_work(work, self.channel, self.rank, self.world_size)
        if note is not None:
            raise self._fail(note)
        try:
            work.wait()
        except Exception as exc:
            raise self._fail(self._diagnose(what, exc)) from None

    def _diagnose(self, what: str, exc: Exception) -> str:
        """Why a data collective failed (its communicator timed out or a peer went away), with the
        peers' notes where they left one."""
        channel = self.channel
        notes = []
        if channel is not None:
            notes = [n for r in range(self.world_size) if r != self.rank and (n := channel.note(r))]
        if notes:
            return notes[0]
        from arnorm.comm._rendezvous import ranks_text

        others = [r for r in range(self.world_size) if r != self.rank]
        missing = others if channel is None or len(others) == 1 else channel.late_ranks(self.calls)
        group = None if channel is None else channel.ranks  # named by global rank
        peers = ranks_text(missing, group) if missing else f"one or more of {ranks_text(others, group)}"
        timeout = channel.timeout if channel is not None else 0
        message = (
            f"peers: {peers} did not join call {self.calls} of "
            f"{channel.describe() if channel is not None else 'this op'} within {timeout:g} s "
            f"(peer_timeout / ARNORM_PEER_TIMEOUT) ({type(exc).__name__}: {str(exc)[:200]}) "
            "(needs every rank to call the op the same number of times: a rank may be stalled or dead, "
            "building or calling another op on this group, or may have passed a different group "
            "object; this op cannot be used again: build a new one)"
        )
        if channel is not None:
            channel.abandon(f"peers: {channel.who([self.rank])} gave up on call {self.calls} ({message})")
        return message

    # -- data collectives on the device group -----------------------------------------------

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order."""
        import torch
        import torch.distributed as dist

        if self.group is None:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        if self._data is not None:
            self._step(tensor.numel())
            self._wait(self._issued(self._data.allgather([parts], [tensor.contiguous()])), "call")
            return parts
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
        if self._data is not None:
            self._step(tensor.numel())
            work = self._data._allgather_base(out.view(-1, *tensor.shape[1:]), tensor.contiguous())
            self._wait(self._issued(work), "call")
            return out
        # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1, *tensor.shape[1:]), tensor.contiguous(), group=self.group)
        return out

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        import torch.distributed as dist

        if self._data is not None:
            self._step(tensor.numel())
            self._wait(self._issued(self._data.allreduce([tensor])), "call")
        elif self.group is not None:
            dist.all_reduce(tensor, group=self.group)
        return tensor


class CallToken(list[Any]):
    """The call token (see ``AllReduceNorm``) of an op whose data collectives carry headers.

    Taking it at the start of every call marks the call as not yet at its data collective, so a
    call that fails knows its number (:meth:`Comm.call_number`) without looking for itself on the
    stack. Only these ops (gloo, CPU, TP > 1) pay for the Python-level ``pop``; the rest keep a
    plain list.
    """

    __slots__ = ("comm",)

    def __init__(self, comm: Comm) -> None:
        super().__init__([None])
        self.comm = comm

    def pop(self, index: SupportsIndex = -1) -> Any:
        item = list.pop(self, index)
        self.comm._stepped = False
        return item


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
    twins = _CPU_GROUPS.setdefault(dist.group.WORLD, {})
    twin = twins.get(ranks)
    if twin is None:
        twin = twins[ranks] = dist.new_group(list(ranks), backend="gloo")
    return twin
