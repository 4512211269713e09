"""Which leases does this agent hold, for whom, and what does its journal say of them?

A :class:`HeldLease` is one lease the agent has memory (or, re-adopted after a restart,
only a live holder) for. :class:`HeldLeases` is the table of them: thread-safe, with the
lease ids that ended lately (so a late renew or release gets a clear error, not "unknown
lease"), and the journal, written before a lease's fd leaves the agent and cleared when
the lease ends (agent/journal.py), so that a restarted agent can re-adopt it.
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agent.backends import Materialised
from agent.backends.emulated import OnceFd
from agent.holders import Holder
from agent.journal import Entry as JournalEntry
from agent.journal import Journal, Watched
from agent.mappings import Inode
from poold.errors import LeaseNotActive, NotOwner, UnknownLease
from poold.wire.common import LeaseOut

ENDED_MEMORY = 4096  # how many ended lease ids the agent remembers, for clear errors


class Ending:
    """A lease's ending, claimed by the one path that ends it (a release, a revocation, a
    holder check: :meth:`HeldLeases.claim_end`); the others wait for its verdict, whether
    the memfd was left watched, rather than judge memory that is no longer theirs.

    Settled by its claimer alone; a lock held until then is what waiters wait on (made
    on every release: a lock costs a tenth of an Event)."""

    __slots__ = ("_settled", "_unsettled", "mapped")

    def __init__(self) -> None:
        self._unsettled = threading.Lock()
        self._unsettled.acquire()
        self._settled = False
        self.mapped = False

    def settle(self, mapped: bool) -> None:
        """The claimer's verdict, once (a later call changes nothing)."""
        if not self._settled:
            self._settled = True
            self.mapped = mapped
            self._unsettled.release()

    def verdict(self, timeout_s: float) -> bool:
        """Whether the memfd was left watched; False when the claimer has not said within
        ``timeout_s`` (it ends the lease its own way either way)."""
        if self._unsettled.acquire(timeout=timeout_s):
            self._unsettled.release()
        return self.mapped


@dataclass
class HeldLease:
    """One lease this agent holds: the ledger's lease, its memory, its holder."""

    lease: LeaseOut
    # None for a lease re-adopted after an agent restart: the holder keeps its
    # own mapping; the agent lost its fd (devdax: the sub-device is by name).
    memory: Materialised | None
    holder_uid: int
    holder_pid: int
    conn_id: int
    ttl_s: int
    expires_at: datetime
    page_size_bytes: int
    holder: Holder | None = None
    sub_device: str | None = None
    region_id: int | None = None
    lost: bool = False
    # poold revoked it: torn down at this time (the tenant is told in renew replies).
    revoke_deadline_at: datetime | None = None
    # Revoked, but a memfd whose live holder still maps it: nothing can take the
    # pages back, so the lease stays revoking (used) until the holder exits.
    revoked_held: bool = False
    # A memfd left unsealed against shrinking (LeaseArgs.shrinkable): `shrink` may cut it.
    shrinkable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # The memfd's inode (taken from the fd when the lease is journalled): how the agent
    # finds who still maps it after the lease ends. None for a dax sub-device.
    inode: Inode | None = None
    # Set once, by the path that ends the lease (:meth:`HeldLeases.claim_end`).
    ending: Ending | None = field(default=None, repr=False, compare=False)

    def journal_entry(self) -> JournalEntry:
        """What the journal keeps of this lease: enough for a restarted agent to re-adopt it."""
        lease = self.lease
        return JournalEntry(
            lease_id=lease.id,
            device_uid=lease.device_uid,
            backend=self.memory.backend if self.memory is not None else lease.device_kind,
            offset_bytes=lease.offset_bytes,
            length_bytes=lease.length_bytes,
            epoch=lease.epoch,
            holder_pid=self.holder_pid,
            holder_uid=self.holder_uid,
            holder_start=self.holder.start_time if self.holder else None,
            ttl_s=self.ttl_s,
            sub_device=self.sub_device,
            region_id=self.region_id,
            lease_json=lease.model_dump_json(),
            st_dev=self.inode.dev if self.inode is not None else None,
            st_ino=self.inode.ino if self.inode is not None else None,
        )


@dataclass
class MappedLease:
    """A memfd lease that ended (released, revoked, orphaned) while some process still
    mapped or held its memfd: watched by inode until none does (DESIGN.md "Memory
    follows the pages"); ``pids`` are the processes the last scan found."""

    lease_id: str
    inode: Inode
    length_bytes: int
    holder_uid: int
    why: str
    since: datetime
    pids: set[int] = field(default_factory=set)
    # The release check's probe (agent/release_check.py), kept while the kernel counts a
    # file of the memfd that /proc may not show (an fd in flight): asked at each rescan.
    probe: OnceFd | None = None


def memfd_inode(memory: Materialised) -> Inode | None:
    """The inode of a lease's memory when it is a memfd (a regular shmem file); None for
    a dax device (a character device the kernel unmaps itself) or a closed fd."""
    try:
        st = os.fstat(memory.fd)
    except OSError:
        return None
    return Inode(st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


class HeldLeases:
    """The held leases by id, the ended ones remembered, and their journal (thread-safe).

    ``lock`` guards the table; the `shrink` operation also holds it while it cuts a
    lease, so that no snapshot sees a length the memory no longer has.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._held: dict[str, HeldLease] = {}
        self._ended: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (state, uid)
        self._mapped: dict[str, MappedLease] = {}  # ended, memfd still mapped: by lease id
        # Set by agent/run.py (None: an agent that keeps no journal, as in most tests).
        self.journal: Journal | None = None

    # --- reading ------------------------------------------------------------------
    def get(self, lease_id: str) -> HeldLease | None:
        with self.lock:
            return self._held.get(lease_id)

    def __contains__(self, lease_id: object) -> bool:
        with self.lock:
            return lease_id in self._held

    def all(self) -> list[HeldLease]:
        with self.lock:
            return list(self._held.values())

    def ids(self) -> list[str]:
        with self.lock:
            return sorted(self._held)

    def visible_to(self, uid: int) -> list[HeldLease]:
        """The leases a peer of ``uid`` may see: its own, or all of them for root."""
        with self.lock:
            return [h for h in self._held.values() if h.holder_uid == uid or uid == 0]

    def of_pid(self, pid: int) -> list[HeldLease]:
        with self.lock:
            return [h for h in self._held.values() if h.holder_pid == pid]

    def revoked_held_ids(self) -> list[str]:
        """Revoked leases whose memfd is still mapped (by their holder or anyone)."""
        with self.lock:
            held = [h.lease.id for h in self._held.values() if h.revoked_held]
            return held + [m.lease_id for m in self._mapped.values() if m.why == "revoked"]

    def mapped(self) -> list[MappedLease]:
        """The ended memfd leases still mapped somewhere (their last scan's pids)."""
        with self.lock:
            return list(self._mapped.values())

    def mapped_visible_to(self, uid: int) -> list[MappedLease]:
        with self.lock:
            return [m for m in self._mapped.values() if m.holder_uid == uid or uid == 0]

    def owned(self, uid: int, lease_id: str, op: str) -> HeldLease:
        """The held lease, if a peer of ``uid`` may ``op`` it; otherwise a coded refusal."""
        with self.lock:
            held = self._held.get(lease_id)
            ended = self._ended.get(lease_id)
        if held is None:
            if ended is not None:
                state, owner = ended
                if owner != uid and uid != 0:
                    raise NotOwner(f"lease {lease_id} is not yours", lease_id=lease_id)
                raise LeaseNotActive(
                    f"lease {lease_id} is {state}; cannot {op} it", lease_id=lease_id, state=state
                )
            raise UnknownLease(f"no lease {lease_id} on this host", lease_id=lease_id)
        if held.holder_uid != uid and uid != 0:
            raise NotOwner(f"lease {lease_id} is held by another user", lease_id=lease_id)
        if held.lost and held.revoke_deadline_at is None:
            raise LeaseNotActive(f"lease {lease_id} was ended by poold", lease_id=lease_id)
        return held

    # --- changing -----------------------------------------------------------------
    def add(self, held: HeldLease) -> None:
        """Hold a lease (journal it first with :meth:`record`, unless it came from there)."""
        if held.inode is None and held.memory is not None:
            held.inode = memfd_inode(held.memory)
        with self.lock:
            self._held[held.lease.id] = held

    def claim_end(self, held: HeldLease) -> Ending | None:
        """Claim the ending of a lease: its :class:`Ending`, for the caller to settle; None
        when another path claimed it first (a tenant's disconnect and the holder watch
        both find a gone holder; a release races a revocation's teardown). Under the
        table's lock, as `shrink` cuts a memfd, so no fd is closed under a truncate."""
        with self.lock:
            if held.ending is not None:
                return None
            held.ending = Ending()
            return held.ending

    def take_memory(self, held: HeldLease) -> Materialised | None:
        """The lease's memory, now the caller's alone to close (None: taken already, or
        re-adopted without any)."""
        with self.lock:
            memory, held.memory = held.memory, None
        return memory

    def forget(self, lease_id: str, state: str) -> HeldLease | None:
        """Stop holding a lease that ended in ``state``; None when another caller did first."""
        with self.lock:
            held = self._held.pop(lease_id, None)
            if held is not None:
                self._ended[lease_id] = (state, held.holder_uid)
                while len(self._ended) > ENDED_MEMORY:
                    self._ended.popitem(last=False)
        if held is not None and self.journal is not None:
            self.journal.remove(lease_id)
        return held

    def watch(
        self, held: HeldLease, why: str, pids: set[int], probe: OnceFd | None = None
    ) -> MappedLease | None:
        """The lease ended (``why``: released, revoked, orphaned) with its memfd still mapped
        by ``pids``: stop holding it and watch its inode instead, in one step, so that no
        heartbeat sees it in neither table (poold frees what the agent reports neither
        holding nor watching). None for a lease without an inode (nothing to watch)."""
        if held.inode is None:
            return None
        watched = MappedLease(
            lease_id=held.lease.id,
            inode=held.inode,
            length_bytes=held.lease.length_bytes,
            holder_uid=held.holder_uid,
            why=why,
            since=datetime.now(UTC),
            pids=set(pids),
            probe=probe,
        )
        with self.lock:
            old = self._mapped.get(watched.lease_id)
            if old is not None:
                # Ended twice (a revocation's teardown and the tenant's release each took
                # it before the other let go): still one watch with one probe. A second
                # probe left open is itself a file of the memfd, and the agent's own fds
                # count in the rescan, so the lease would never look free again.
                watched.why, watched.since = old.why, old.since
                watched.pids |= old.pids
                if watched.probe is None:
                    watched.probe, old.probe = old.probe, None
            self._mapped[watched.lease_id] = watched
            self._held.pop(watched.lease_id, None)  # a release forgot it already
            self._ended[watched.lease_id] = (f"{watched.why}_mapped", held.holder_uid)
            while len(self._ended) > ENDED_MEMORY:
                self._ended.popitem(last=False)
        if old is not None and old.probe is not None and old.probe is not watched.probe:
            old.probe.close()
        if self.journal is not None:
            self.journal.watch(
                Watched(
                    lease_id=watched.lease_id,
                    st_dev=watched.inode.dev,
                    st_ino=watched.inode.ino,
                    length_bytes=watched.length_bytes,
                    holder_uid=watched.holder_uid,
                    why=watched.why,
                    since=watched.since.timestamp(),
                )
            )
        return watched

    def unwatch(self, lease_id: str) -> MappedLease | None:
        """No process maps or holds the memfd any more; None when it was not watched."""
        with self.lock:
            gone = self._mapped.pop(lease_id, None)
        if gone is not None and gone.probe is not None:
            gone.probe.close()
        if gone is not None and self.journal is not None:
            self.journal.unwatch(lease_id)
        return gone

    def rewatch(self, entry: Watched) -> None:
        """Watch again what the journal says was still mapped (agent restart)."""
        with self.lock:
            self._mapped[entry.lease_id] = MappedLease(
                lease_id=entry.lease_id,
                inode=Inode(entry.st_dev, entry.st_ino),
                length_bytes=entry.length_bytes,
                holder_uid=entry.holder_uid,
                why=entry.why,
                since=datetime.fromtimestamp(entry.since, UTC),
            )

    def take_all(self) -> list[HeldLease]:
        """Empty the table (the agent shuts down); the journal keeps the leases."""
        with self.lock:
            held, self._held = list(self._held.values()), {}
        return held

    def record(self, held: HeldLease) -> None:
        """Write the lease's journal entry (where its memory is, who holds it)."""
        if held.inode is None and held.memory is not None:
            held.inode = memfd_inode(held.memory)  # before the fd leaves the agent
        if self.journal is None:
            return
        self.journal.add(held.journal_entry())
