"""What happens to an op when something goes wrong between ranks: poisoning, threads, fork.

An op whose collectives may have fallen out of step with its peers' is *poisoned*, the way NCCL
aborts a communicator: its call plan (:mod:`arnorm.op._plan`) is replaced whole by one whose
tables hold :class:`Poisoned`, so every later call raises the same :class:`arnorm.PeerError` and
the valid-call path pays nothing for the check.
Causes: a backend call that raised part-way at TP > 1 (:func:`call_failed`), a peer's poison
note, a peer timeout, or a fork (the child's copies of every op).

Threads: the collectives of two ops sharing a group must run in the same order on every rank, which
no lock can promise (two ranks may take it in different orders). The rule every rank can enforce
alike: the thread that builds a group's first live op owns the group; every op on it is built and
called from that thread (:func:`claim_group`, and one identity compare per call).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from typing import Any

from arnorm._errors import InvalidInputError, PeerError

__all__ = ["Poisoned", "call_failed", "claim_group", "is_destroyed", "poison", "thread_error", "track"]

#: Per process: group name -> (owner thread id, the live ops on the group).
_OWNERS: dict[str, tuple[int, weakref.WeakSet[Any]]] = {}
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_PID = os.getpid()
_EXIT_HOOK = False


class Poisoned:
    """A call-plan table entry of a poisoned op: every call raises the op's :class:`PeerError`."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PeerError(self.message)


def poison(op: Any, message: str) -> None:
    """Make every later call of ``op`` raise ``PeerError(message)`` (local; idempotent)."""
    plan = op._plan
    if plan.poisoned is not None or plan.closed:
        return
    op._plan = plan.emptied(poisoned=message, entry=Poisoned(message))


def call_failed(op: Any, exc: BaseException) -> None:
    """A backend call of ``op`` raised: at TP > 1 its collectives may be out of step with the peers'.

    The op is poisoned on this rank; the Comm tells the peers in the collective slot this rank
    skipped (or the next one), and a note in the store says why for peers whose wait ends.
    """
    plan = op._plan
    comm = plan.comm
    if comm is None or comm.world_size == 1 or plan.poisoned is not None:
        return
    if isinstance(exc, PeerError):
        message = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if comm.counts_calls:
            which = f"its call {comm.call_number()}"
        else:
            which = "a call"
        message = (
            f"op out of step on rank {comm.rank}: {which} failed with {text}; "
            "build a new op (the failed call's collectives may be missing on that rank, so no rank "
            "may use this op again)"
        )
    poison(op, message)
    comm.abort(message)


def thread_error(owner: int, where: str = "op") -> InvalidInputError:
    here = threading.current_thread()
    names = {t.ident: t.name for t in threading.enumerate()}
    return InvalidInputError(
        f"{where}: called from thread {here.name!r} on a TP group whose ops belong to thread "
        f"{names.get(owner, owner)!r}, which built its first live op (needs every op on a TP group "
        "built and called from one thread, the same on every rank: two threads' collectives on one "
        "group would pair differently on different ranks)"
    )


def claim_group(name: str, op: Any, where: str = "AllReduceNorm") -> int:
    """Record ``op`` as a live op of group ``name`` built by this thread; raise when another thread
    owns the group. Returns the owner's thread id (what each call compares)."""
    me = threading.get_ident()
    entry = _OWNERS.get(name)
    if entry is not None and len(entry[1]) and entry[0] != me:
        raise thread_error(entry[0], where)
    if entry is None or not len(entry[1]):
        entry = (me, weakref.WeakSet())
        _OWNERS[name] = entry
    entry[1].add(op)
    return me


def group_owner(name: str) -> int | None:
    """The thread owning group ``name`` while it has live ops, else ``None``."""
    entry = _OWNERS.get(name)
    return entry[0] if entry is not None and len(entry[1]) else None


def release(name: str, op: Any) -> None:
    entry = _OWNERS.get(name)
    if entry is not None:
        entry[1].discard(op)


def track(op: Any) -> None:
    """Poison ``op``'s copy in a forked child (the collectives and device state are the parent's),
    and close it at interpreter exit if its group is destroyed by then."""
    global _EXIT_HOOK
    if not _EXIT_HOOK:  # registered with the first op: after the handlers of whoever built it
        atexit.register(_close_orphans)
        _EXIT_HOOK = True
    _LIVE.add(op)


def is_destroyed(group: Any) -> bool:
    """Whether ``group`` is no longer registered with torch.distributed (destroy_process_group)."""
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except Exception:  # KeyError (torch 2.x): no longer registered
        return True
    return False


def _close_orphans() -> None:
    """At interpreter exit, close every op still open whose group was destroyed: it can make no
    call, and the group it holds would live into interpreter shutdown, where a gloo worker still
    letting go of the last collective's tensors can abort the process."""
    for op in list(_LIVE):
        comm = getattr(op, "_comm", None)
        group = getattr(comm, "group", None)
        if group is not None and not getattr(op, "_closed", True) and is_destroyed(group):
            with contextlib.suppress(Exception):  # at exit: a close that fails changes nothing
                op.close()


def _after_fork_in_child() -> None:
    global _PID
    parent, _PID = _PID, os.getpid()
    message = (
        f"op: used in process {_PID}, a fork of process {parent} that built it (needs an op built in "
        "this process: a forked child shares none of its parent's communicators; build ops after the "
        "fork, or start workers with the 'spawn' method)"
    )
    for op in list(_LIVE):
        poison(op, message)
    _OWNERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
