"""Agreement between ranks over the process group's store, apart from every data collective.

Construction's gathers (arguments, verdicts, setup results) and ``ARNORM_CHECK_CALLS``'s per-call
fingerprints used to travel over the TP group's gloo communicator, where they paired with whatever
collective a peer happened to issue next: another op's call, another construction, a call that a
failed rank never made. Here each gather is a set of store keys named after the group's ranks, the
op's build number on that group and the gather's step, so a message can only meet the message of
the same step of the same op. Every wait is bounded by ``Config.peer_timeout`` and watches the
peers' abandon notes, so a rank that raised, was interrupted or poisoned its op tells the others at
once instead of leaving them waiting.

Build numbers count, per process and per group (by its ranks), the ops whose construction began.
They drift when a construction fails on some ranks only; a rank that finds a peer already building a
later op joins that one (the agreement that follows compares every argument, so joining can never
pair two different ops).
"""

from __future__ import annotations

import contextlib
import pickle
import time
from typing import Any

from arnorm._errors import PeerError, StoreLostError

__all__ = ["Channel", "open_agreement", "ranks_text"]

#: Per process: the last build number used on each group, keyed by the group's global ranks.
_BUILDS: dict[tuple[Any, ...], int] = {}
#: How often a waiting rank looks for its peers' abandon notes (seconds).
_SLICE_S = 0.25
_WHY = (
    "a rank may be stalled or dead, still compiling, building or calling another op on this group, "
    "or may have passed a different group object"
)


def default_store() -> Any:
    """The default process group's store, or ``None`` (then agreement falls back to the CPU group)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # not initialized through a store, or an older torch
        return None


class Channel:
    """The store keys one op's ranks agree through: ``arnorm/<ranks>/b<build>/...``."""

    def __init__(
        self, store: Any, ranks: tuple[int, ...], rank: int, timeout: float, namespace: str = "arnorm"
    ) -> None:
        self.store, self.ranks, self.rank, self.timeout = store, ranks, rank, timeout
        self.world = len(ranks)
        # Another namespace (fuse()'s agreement) counts its builds apart from the ops'.
        self._count = ranks if namespace == "arnorm" else (namespace, *ranks)
        self.group = f"{namespace}/" + ",".join(map(str, ranks))
        self.build = _BUILDS.get(self._count, 0) + 1
        _BUILDS[self._count] = self.build
        self.step = 0
        #: What agrees here, for messages: an op, or fuse() (its own namespace).
        self.what = "op" if namespace == "arnorm" else namespace.removeprefix("arnorm-") + "()"
        #: What the op is doing, for messages: "building" until construction ends, then "calling".
        self.phase = "building"
        self._own: str | None = None  # this rank's key of the previous gather, deleted after the next
        #: Set when the store stopped answering: nothing is asked of it afterwards.
        self.lost = False
        #: Gathers this rank completed on this build (told to the peers when it abandons the op).
        self.passed = 0
        try:
            self.store.set(f"{self.group}/at/{rank}", str(self.build))
        except Exception as exc:
            raise self.store_lost(exc) from None

    @property
    def prefix(self) -> str:
        return f"{self.group}/b{self.build}"

    def describe(self) -> str:
        return f"{self.what} #{self.build} on group {list(self.ranks)}"

    def who(self, positions: list[int]) -> str:
        """Ranks named as the group lists them (global ranks), each with its position in the group
        in brackets where the two differ: ``[1]`` on group [1, 2] -> ``"rank 2 [group rank 1]"``."""
        return ranks_text(positions, self.ranks)

    # -- gather -------------------------------------------------------------------------------

    def gather(self, obj: object) -> list[Any]:
        """Every rank's ``obj`` in rank order; raises :class:`PeerError` on a peer's abandon note
        or when a peer has not arrived within the timeout."""
        step = self.step
        self.step += 1
        store = self.store
        payload = pickle.dumps(obj)
        try:
            store.set(self._key(step, self.rank), payload)
            self._wait(step, self.phase, payload)
            got = [pickle.loads(store.get(self._key(step, r))) for r in range(self.world)]
        except Exception as exc:
            raise self.store_lost(exc) from None
        if self._own is not None:
            # Every peer has read it: they wrote this step's key only after reading the previous one.
            with contextlib.suppress(Exception):  # a store without deletion only grows
                store.delete_key(self._own)
        self._own = self._key(step, self.rank)
        self.passed = step + 1
        return got

    def _key(self, step: int, rank: int) -> str:
        return f"{self.prefix}/s{step}/{rank}"

    def _wait(self, step: int, what: str, payload: bytes) -> None:
        store = self.store
        peers = [r for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while True:
            # A first step's key may be a leftover of a peer's failed attempt at this build number:
            # a peer already at a later build is joined there. (A peer still at this one that
            # abandoned it is caught at the next step, where its key is missing.)
            if step == 0 and self._join_later_build(peers, payload):
                continue
            missing = [r for r in peers if not store.check([self._key(step, r)])]
            if not missing:
                # Every key is there, but a peer may have written its own and then given up on this
                # step (its wait timed out before this rank arrived): it will never read this rank's.
                self._raise_if_gave_up(peers, step)
                return
            # A peer may write this step's key, finish the step and abandon the op (it raised the
            # error every rank raises) between the check above and the look at its notes: a note
            # counts only for a peer whose key is still missing after the note was seen.
            self.raise_if_abandoned(missing, lambda r: not store.check([self._key(step, r)]))
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.timeout_error(missing, what)
            # Polled (store.wait with a short timeout logs a warning per slice): fast at first,
            # where a peer is usually a moment behind, then a few times a second.
            time.sleep(min(pause, left))
            pause = min(pause * 2, _SLICE_S)

    def _raise_if_gave_up(self, peers: list[int], step: int) -> None:
        """PeerError when a peer abandoned this build before completing gather ``step``."""
        for r in peers:
            note = self.note(r)
            if note is not None and self.passed_by(r) <= step:
                raise PeerError(self._late_message(r, note))

    def _late_message(self, rank: int, note: str) -> str:
        at = self._read(f"{self.prefix}/abandon_at/{rank}")
        when = ""
        if at is not None:
            t = float(at)
            stamp = time.strftime("%H:%M:%S", time.gmtime(t))
            when = f" at {stamp} UTC, {max(0.0, time.time() - t):.1f} s before this rank arrived"
        return (
            f"peers: {self.who([rank])} gave up on {self.phase} {self.describe()}{when} ({note}) "
            f"(needs every rank of the group to reach it within peer_timeout / ARNORM_PEER_TIMEOUT, "
            f"{self.timeout:g} s: build the op again on every rank)"
        )

    def _join_later_build(self, missing: list[int], payload: bytes) -> bool:
        """A peer already building a later op on this group: this rank's count fell behind (a
        construction that failed on some ranks only). Leave this build number and join that one."""
        ahead = [r for r in missing if self.where(r) > self.build]
        if not ahead:
            return False
        # A peer that completed this first gather, with this rank's key, and then left (the error
        # every rank raises) is no drift: it began its next op before this rank looked. Its key
        # here is no leftover, and this rank completes the gather with it.
        if all(self.passed_by(r) > 0 for r in ahead):
            return False
        later = max(self.where(r) for r in ahead)
        self.abandon(f"peers: {self.who([self.rank])} moved on to op #{later} on group {list(self.ranks)}")
        self.build = _BUILDS[self._count] = later
        self.store.set(f"{self.group}/at/{self.rank}", str(later))
        self.store.set(self._key(0, self.rank), payload)
        return True

    def done(self) -> None:
        """This rank leaves an agreement whose gathers all completed (one of a gather, as fuse()'s).
        A peer still in the last gather may find this rank already at its next build: the count of
        gathers noted here tells it that is no drift (see :meth:`_join_later_build`). The last rank
        to leave deletes the keys."""
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}/passed/{self.rank}", str(self.passed))
        self.release()

    def release(self) -> None:
        """This rank is done with the op (closed or dropped). The last rank to say so deletes the
        op's keys: every rank has then read all it will read (without this, 4 keys per op stayed in
        the store for the job's life)."""
        store = self.store
        if self.lost:
            return
        with contextlib.suppress(Exception):  # a store that is gone, or cannot count or delete
            if store.add(f"{self.prefix}/closed", 1) < self.world:
                return
            keys = [self._key(self.step - 1, r) for r in range(self.world)] if self.step else []
            # The op's gloo communicator's rendezvous (Comm.open_data), and notes of a failed op.
            keys += [f"{self.prefix}/data/0/{r}" for r in range(self.world)]
            keys += [
                f"{self.prefix}/{note}/{r}"
                for note in ("abandon", "abandon_at", "passed")
                for r in range(self.world)
            ]
            for key in [*keys, f"{self.prefix}/closed"]:
                store.delete_key(key)

    def store_lost(self, exc: Exception) -> Exception:
        """``exc`` as :class:`StoreLostError` when it says the store's connection is gone (its host
        died: torch raises ``DistNetworkError``, "Broken pipe"), else ``exc`` itself."""
        if type(exc).__name__ != "DistNetworkError":
            return exc
        self.lost = True
        return StoreLostError(
            f"store: gone while {self.phase} {self.describe()} ({type(exc).__name__}: {str(exc)[:200]}) "
            "(needs a live c10d store: its host, rank 0 of the job unless the engine passed a store of "
            "its own, died or closed it, and no op can be built or checked on a group over it; restart "
            "the job, or destroy_process_group() and init_process_group() on every rank)"
        )

    # -- notes --------------------------------------------------------------------------------

    def abandon(self, reason: str) -> None:
        """Tell the peers this rank left the op (its construction failed, or the op was poisoned)."""
        # The store itself may be gone: the peers' waits then end at their timeout.
        with contextlib.suppress(Exception):
            # Before the note: a peer that sees this rank at a later op reads both.
            self.store.set(f"{self.prefix}/passed/{self.rank}", str(self.passed))
            self.store.set(f"{self.prefix}/abandon_at/{self.rank}", repr(time.time()))
            self.store.set(f"{self.prefix}/abandon/{self.rank}", reason)

    def _read(self, key: str) -> bytes | None:
        """``key``'s value, or ``None`` when it is absent or the store cannot say."""
        try:
            return self.store.get(key) if self.store.check([key]) else None
        except Exception:
            return None

    def passed_by(self, rank: int) -> int:
        """The gathers rank ``rank`` completed on this build before it abandoned it (0: unknown)."""
        got = self._read(f"{self.prefix}/passed/{rank}")
        return 0 if got is None else int(got)

    def note(self, rank: int) -> str | None:
        """Rank ``rank``'s abandon note on this op, if any."""
        got = self._read(f"{self.prefix}/abandon/{rank}")
        return None if got is None else got.decode()

    def raise_if_abandoned(self, ranks: list[int], still_missing: Any = None) -> None:
        for r in ranks:
            note = self.note(r)
            if note is not None and (still_missing is None or still_missing(r)):
                raise PeerError(note)

    def late_ranks(self, call: int, grace: float = 1.0) -> list[int]:
        """After this rank's wait in call ``call`` timed out: the peers that did not also report
        waiting there within ``grace`` seconds (the ranks that were waited for)."""
        store = self.store
        key = f"{self.prefix}/late{call}"
        with contextlib.suppress(Exception):
            store.set(f"{key}/{self.rank}", "1")
        peers = [r for r in range(self.world) if r != self.rank]
        end = time.monotonic() + min(grace, self.timeout)
        while True:
            try:
                late = [r for r in peers if not store.check([f"{key}/{r}"])]
            except Exception:
                return peers
            if not late or time.monotonic() >= end:
                return late
            time.sleep(0.05)

    def where(self, rank: int) -> int:
        got = self._read(f"{self.group}/at/{rank}")
        return 0 if got is None else int(got)

    def timeout_error(self, missing: list[int], what: str) -> PeerError:
        seen = "; ".join(
            f"{self.who([r])} last began building op #{self.where(r)} on this group" for r in missing
        )
        return PeerError(
            f"peers: {self.who(missing)} did not reach {what} {self.describe()} within {self.timeout:g} s "
            f"(peer_timeout / ARNORM_PEER_TIMEOUT) ({seen}; this rank is at op #{self.build}) "
            f"(needs every rank of the group to build and call the same ops in the same order: {_WHY})"
        )


def ranks_text(ranks: list[int], group: tuple[int, ...] | None = None) -> str:
    """``[1]`` -> ``"rank 1"``; ``[1, 3]`` -> ``"ranks 1, 3"``. With ``group`` (its global ranks),
    ``ranks`` are positions in it, named by global rank: ``[1], (1, 2)`` -> ``"rank 2 [group rank 1]"``."""

    def one(r: int) -> str:
        if group is None or group[r] == r:
            return str(r)
        return f"{group[r]} [group rank {r}]"

    return f"rank {one(ranks[0])}" if len(ranks) == 1 else "ranks " + ", ".join(map(one, ranks))


def open_agreement(comm: Any, timeout: float) -> None:
    """Agreement through the store, each wait bounded by ``timeout`` seconds (``peer_timeout``)."""
    store = default_store()
    if store is None:
        return
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(comm.group))
    comm.channel = Channel(store, ranks, comm.rank, timeout)
