"""Keeping a gloo op's collectives in step when a call is interrupted, rejected on some ranks only,
or fails in check mode; the header protocol itself is :class:`arnorm.comm._comm.Comm`'s.

- **Waits are polled in Python.** A rank blocked inside gloo's ``wait()`` handles a signal only
  when the wait returns: a SIGINT then surfaced between a step's header and its data, and the poison
  header sent in the data's slot paired with the peers' data (a wrong result there, and an abort
  inside gloo here). :func:`wait_work` sleeps in short slices instead, so a ``KeyboardInterrupt`` or
  a ``SystemExit`` from a signal handler is raised at once, and it reads the peers' notes a few
  times a second, so a peer that left the op part-way ends the wait with its note.
- **A rank whose header is out and whose data is not** (:attr:`Comm.mid_step`) sends no poison
  header: its peers wait for data there, and only the store note can tell them.
- **A call rejected before its collective** on this rank (:func:`call_rejected`) sends a *skip*
  header in that collective's slot: peers that made the call raise :class:`arnorm.PeerError`
  instead of pairing the slot with this rank's next call; when every rank rejected it, every rank
  skipped the same slot and the op stays usable.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["call_rejected", "wait_work"]

#: Polls of a pending collective that only yield the GIL, before the sleeps start (most small
#: collectives finish within them).
_SPINS = 50
#: The longest sleep between two polls, and how often the peers' notes are read (seconds).
_MAX_PAUSE_S = 0.002
_NOTES_EVERY_S = 0.25


def wait_work(work: Any, channel: Any, rank: int, world: int) -> str | None:
    """Wait until ``work`` is completed (done or failed); the first peer note found on the way
    (the peer left the op: the work may never complete), else ``None``."""
    for _ in range(_SPINS):
        if work.is_completed():
            return None
        time.sleep(0)
    pause = 5e-5
    look = time.monotonic() + 0.02
    while not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE_S)
        if channel is not None and time.monotonic() >= look:
            for r in range(world):
                note = channel.note(r) if r != rank else None
                if note is not None:
                    return note
            look = time.monotonic() + _NOTES_EVERY_S
    return None


def call_rejected(comm: Any) -> None:
    """The call in progress of an op over ``comm``, neither poisoned nor closed, raised before (or
    without) its collective on this rank: on a gloo op, tell the peers in the collective's slot."""
    if comm is None or comm.world_size == 1 or comm.stepped:
        return
    comm.skip()
