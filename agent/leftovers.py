"""Which dax sub-devices did this agent make that no lease it holds accounts for?

Every sub-device made for a lease is remembered, with its lease, in the journal's
`sub_devices` table (agent/journal.py; in memory when the agent runs without a
journal). Each heartbeat the sweep looks at the records no held lease ties to a
sub-device (none in the steady state, so no sysfs read at all):

* the sub-device is gone from its region, or has another size (the kernel reused
  the name): the record is dropped, that teardown happened;
* it is still there: a *leftover*, e.g. a revoke whose unbind or delete failed
  ("left for the audit to find", agent/backends/devdax.py), or an agent killed
  between releasing a lease and tearing it down. Once seen for `settle_s` (a
  teardown in progress is not a leftover) it goes into the heartbeat, and the
  audit compares its lease with the ledger.

When poold revokes the lease id of a leftover (`poolctl audit --reclaim`, the
ledger ended that lease), :meth:`LeftoverSweep.delete` destroys the sub-device the
way a revoke does. A sub-device a held lease ties to is never touched.

A scrub's temporary sub-device is recorded too, with the lease whose range it
zeroes, from before it is sized until it is deleted (agent/memory.py ties it
while the scrub runs, so it is never a leftover then). A record is written before
its sub-device holds a byte, so an empty sub-device is taken for "torn down" only
once its record is `settle_s` old.

At agent start (:meth:`LeftoverSweep.clean_start`, before serving) every recorded
sub-device no re-adopted lease ties is destroyed: after a crash it is a lease's
whose teardown never ran, or a scrub's; the ledger's scrub order, which poold
sends again, is then redone on a clean region.

Static regions (leased whole through their one device, which always exists) have
no leftovers: their records are dropped once no held lease ties them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from agent.backends import Backend
from agent.journal import Journal, SubDevice
from poold.errors import BackendFailed
from poold.wire.agent import LeftoverSubDevice

log = logging.getLogger("pool_agent.leftovers")

# A sub-device must be seen untied this long before it is reported: a release or
# revoke forgets the lease a moment before its teardown completes.
LEFTOVER_SETTLE_S = 10.0
# At most this many per heartbeat (the wire's cap, poold.wire.Heartbeat.leftovers).
MAX_REPORTED = 10_000

Key = tuple[int, str]  # (dax region id, sub-device name)
# Held leases' sub-devices: (region id, sub-device) -> (lease id, length in bytes).
Tied = dict[Key, tuple[str, int]]


class LeftoverSweep:
    """Finds (and on poold's word deletes) leftover sub-devices; thread-safe."""

    def __init__(
        self,
        backend: Backend | None,
        *,
        settle_s: float = LEFTOVER_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.settle_s = settle_s
        self.clock = clock
        self._lock = threading.Lock()  # one sweep or delete at a time
        # The records, when there is no journal. Their own lock: `record` runs while the
        # backend carves (under its lock), and `delete` revokes under ours.
        self._memory: dict[Key, SubDevice] = {}
        self._memory_lock = threading.Lock()
        self._first_seen: dict[tuple[int, str, str], float] = {}

    # --- records -------------------------------------------------------------
    def _records(self, journal: Journal | None) -> dict[Key, SubDevice]:
        if journal is not None:
            found = journal.sub_devices()
        else:
            with self._memory_lock:
                found = list(self._memory.values())
        return {(r.region_id, r.sub_device): r for r in found}

    def _note(self, journal: Journal | None, sub: SubDevice) -> None:
        if journal is not None:
            journal.note_sub_device(sub)
        else:
            with self._memory_lock:
                self._memory[(sub.region_id, sub.sub_device)] = sub

    def _forget(self, journal: Journal | None, sub: SubDevice) -> None:
        if journal is not None:
            journal.forget_sub_device(sub)
        else:
            with self._memory_lock:
                if self._memory.get((sub.region_id, sub.sub_device)) == sub:
                    del self._memory[(sub.region_id, sub.sub_device)]

    def _sizes(self, region_id: int) -> dict[str, int] | None:
        """The region's sub-devices and their sizes; {} for a static region (no leftovers);
        None when sysfs cannot tell (region unreadable or gone): the records are kept."""
        assert self.backend is not None
        try:
            return self.backend.sub_device_sizes(region_id)
        except (BackendFailed, OSError) as err:
            log.warning("cannot read the sub-devices of dax region %d: %s", region_id, err)
            return None

    def _untied(
        self,
        records: Iterable[SubDevice],
        tied: Tied,
        journal: Journal | None,
        *,
        carving: bool = True,
    ) -> list[tuple[SubDevice, int]]:
        """Records no held lease ties, whose sub-device is still there (with its size);
        the others, whose sub-device is gone, are dropped.

        ``carving``: a carve may be running, so an empty sub-device with a record younger
        than `settle_s` is kept (it is recorded before it is sized; its tie may be newer
        than the caller's `tied`). False at start, when nothing is being carved.
        """
        out: list[tuple[SubDevice, int]] = []
        sizes: dict[int, dict[str, int] | None] = {}
        now = time.time()
        for rec in records:
            if (rec.region_id, rec.sub_device) in tied:
                continue
            if rec.region_id not in sizes:
                sizes[rec.region_id] = self._sizes(rec.region_id)
            region = sizes[rec.region_id]
            if region is None:
                continue
            size = region.get(rec.sub_device, 0)
            if size == 0 and carving and now - rec.created_at < self.settle_s:
                continue  # maybe about to be sized
            if size == 0 or size != rec.length_bytes:
                self._forget(journal, rec)  # torn down (a seed of size 0 is not ours)
                continue
            out.append((rec, size))
        return out

    # --- the agent's side (agent/memory.py, agent/restart.py) -----------------
    # Neither takes the sweep's lock: `record` runs inside a carve (the backend's lock
    # held), and a delete takes the backend's lock under the sweep's.
    def record(self, journal: Journal | None, sub: SubDevice) -> None:
        """Remember a sub-device about to be made (before it is sized)."""
        self._note(journal, sub)

    def forget(self, journal: Journal | None, sub: SubDevice) -> None:
        """The sub-device was deleted: drop its record (a newer lease's, same name, stays)."""
        self._forget(journal, sub)

    def clean_start(self, journal: Journal | None, tied: Tied) -> list[str]:
        """At agent start, before serving: destroy every recorded sub-device no held
        lease ties (a crash's leftovers), drop the records of those already gone; the
        names destroyed. One that cannot be destroyed stays recorded, for the audit."""
        if self.backend is None:
            return []
        with self._lock:
            ids = {rec.lease_id for rec in self._records(journal).values()}
        return self._delete(journal, ids, tied, at_start=True)

    # --- the heartbeat's side ------------------------------------------------
    def sweep(self, journal: Journal | None, tied: Tied) -> list[LeftoverSubDevice]:
        """The leftovers to report now (seen for `settle_s`); records what `tied` adds."""
        if self.backend is None:
            return []
        with self._lock:
            records = self._records(journal)
            # A held lease journalled before the table existed, or an agent without a
            # journal, is recorded here; a reused name now belongs to the held lease.
            for key, (lease_id, length) in tied.items():
                rec = records.get(key)
                if rec is None or rec.lease_id != lease_id:
                    rec = SubDevice(key[0], key[1], lease_id, length, time.time())
                    self._note(journal, rec)
                    records[key] = rec
            now = self.clock()
            seen: dict[tuple[int, str, str], float] = {}
            out: list[LeftoverSubDevice] = []
            for rec, size in self._untied(records.values(), tied, journal):
                mark = (rec.region_id, rec.sub_device, rec.lease_id)
                first = seen[mark] = self._first_seen.get(mark, now)
                if now - first >= self.settle_s:
                    out.append(
                        LeftoverSubDevice(
                            sub_device=rec.sub_device,
                            region_id=rec.region_id,
                            size_bytes=size,
                            lease_id=rec.lease_id,
                        )
                    )
            self._first_seen = seen
        return out[:MAX_REPORTED]

    def delete(self, journal: Journal | None, lease_ids: Iterable[str], tied: Tied) -> list[str]:
        """Destroy the leftover sub-devices of these (ended) leases; the names destroyed."""
        return self._delete(journal, lease_ids, tied, at_start=False)

    def _delete(
        self, journal: Journal | None, lease_ids: Iterable[str], tied: Tied, *, at_start: bool
    ) -> list[str]:
        if self.backend is None:
            return []
        wanted = set(lease_ids)
        deleted: list[str] = []
        with self._lock:
            records = [r for r in self._records(journal).values() if r.lease_id in wanted]
            for rec, _size in self._untied(records, tied, journal, carving=not at_start):
                try:
                    # As a revoke: unbind (the kernel unmaps it from every process), delete.
                    self.backend.revoke(rec.region_id, rec.sub_device)
                except BackendFailed:
                    log.exception(
                        "deleting leftover %s of lease %s (left for the next audit)",
                        rec.sub_device,
                        rec.lease_id,
                    )
                    continue
                log.warning(
                    "deleted leftover sub-device %s of lease %s (%s)",
                    rec.sub_device,
                    rec.lease_id,
                    "left by the agent's last run" if at_start else "the lease ended",
                )
                self._forget(journal, rec)
                self._first_seen.pop((rec.region_id, rec.sub_device, rec.lease_id), None)
                deleted.append(rec.sub_device)
        return deleted
