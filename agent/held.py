"""Which leases does this agent hold, for whom, and what does its journal say of them?

A :class:`HeldLease` is one lease the agent has memory (or, re-adopted after a restart,
only a live holder) for. :class:`HeldLeases` is the table of them: thread-safe, with the
lease ids that ended lately (so a late renew or release gets a clear error, not "unknown
lease"), and the journal, written before a lease's fd leaves the agent and cleared when
the lease ends (agent/journal.py), so that a restarted agent can re-adopt it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agent.backends import Materialised
from agent.holders import Holder
from agent.journal import Entry as JournalEntry
from agent.journal import Journal
from poold.errors import LeaseNotActive, NotOwner, UnknownLease
from poold.wire.common import LeaseOut

ENDED_MEMORY = 4096  # how many ended lease ids the agent remembers, for clear errors


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


class HeldLeases:
    """The held leases by id, the ended ones remembered, and their journal (thread-safe).

    ``lock`` guards the table; the `shrink` operation also holds it while it cuts a
    lease, so that no snapshot sees a length the memory no longer has.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._held: dict[str, HeldLease] = {}
        self._ended: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (state, uid)
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
        """Revoked leases still mapped by their live holders."""
        with self.lock:
            return [h.lease.id for h in self._held.values() if h.revoked_held]

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
        with self.lock:
            self._held[held.lease.id] = held

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

    def take_all(self) -> list[HeldLease]:
        """Empty the table (the agent shuts down); the journal keeps the leases."""
        with self.lock:
            held, self._held = list(self._held.values()), {}
        return held

    def record(self, held: HeldLease) -> None:
        """Write the lease's journal entry (where its memory is, who holds it)."""
        if self.journal is None:
            return
        lease = held.lease
        self.journal.add(
            JournalEntry(
                lease_id=lease.id,
                device_uid=lease.device_uid,
                backend=held.memory.backend if held.memory is not None else lease.device_kind,
                offset_bytes=lease.offset_bytes,
                length_bytes=lease.length_bytes,
                epoch=lease.epoch,
                holder_pid=held.holder_pid,
                holder_uid=held.holder_uid,
                holder_start=held.holder.start_time if held.holder else None,
                ttl_s=held.ttl_s,
                sub_device=held.sub_device,
                region_id=held.region_id,
                lease_json=lease.model_dump_json(),
            )
        )
