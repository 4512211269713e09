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

Static regions (leased whole through their one device, which always exists) have
no leftovers: their records are dropped once no held lease ties them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from agent.backends.devdax import DevdaxBackend
from agent.journal import Journal, SubDevice
from poold.api.schemas import LeftoverSubDevice
from poold.errors import BackendFailed

log = logging.getLogger("pool_agent.leftovers")

# A sub-device must be seen untied this long before it is reported: a release or
# revoke forgets the lease a moment before its teardown completes.
LEFTOVER_SETTLE_S = 10.0
# At most this many per heartbeat (the wire's cap, poold.api.schemas.Heartbeat.leftovers).
MAX_REPORTED = 10_000

Key = tuple[int, str]  # (dax region id, sub-device name)
# Held leases' sub-devices: (region id, sub-device) -> (lease id, length in bytes).
Tied = dict[Key, tuple[str, int]]


class LeftoverSweep:
    """Finds (and on poold's word deletes) leftover sub-devices; thread-safe."""

    def __init__(
        self,
        backend: DevdaxBackend | None,
        *,
        settle_s: float = LEFTOVER_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.settle_s = settle_s
        self.clock = clock
        self._lock = threading.Lock()
        self._memory: dict[Key, SubDevice] = {}  # the records, when there is no journal
        self._first_seen: dict[tuple[int, str, str], float] = {}

    # --- records -------------------------------------------------------------
    def _records(self, journal: Journal | None) -> dict[Key, SubDevice]:
        found = journal.sub_devices() if journal is not None else list(self._memory.values())
        return {(r.region_id, r.sub_device): r for r in found}

    def _note(self, journal: Journal | None, sub: SubDevice) -> None:
        if journal is not None:
            journal.note_sub_device(sub)
        else:
            self._memory[(sub.region_id, sub.sub_device)] = sub

    def _forget(self, journal: Journal | None, sub: SubDevice) -> None:
        if journal is not None:
            journal.forget_sub_device(sub)
        elif self._memory.get((sub.region_id, sub.sub_device)) == sub:
            del self._memory[(sub.region_id, sub.sub_device)]

    def _sizes(self, region_id: int) -> dict[str, int] | None:
        """The region's sub-devices and their sizes; {} for a static region (no leftovers);
        None when sysfs cannot tell (region unreadable or gone): the records are kept."""
        assert self.backend is not None
        try:
            if self.backend.region(region_id).static:
                return {}
            return self.backend.sub_devices(region_id)
        except (BackendFailed, OSError) as err:
            log.warning("cannot read the sub-devices of dax region %d: %s", region_id, err)
            return None

    def _untied(
        self, records: Iterable[SubDevice], tied: Tied, journal: Journal | None
    ) -> list[tuple[SubDevice, int]]:
        """Records no held lease ties, whose sub-device is still there (with its size);
        the others, whose sub-device is gone, are dropped."""
        out: list[tuple[SubDevice, int]] = []
        sizes: dict[int, dict[str, int] | None] = {}
        for rec in records:
            if (rec.region_id, rec.sub_device) in tied:
                continue
            if rec.region_id not in sizes:
                sizes[rec.region_id] = self._sizes(rec.region_id)
            region = sizes[rec.region_id]
            if region is None:
                continue
            size = region.get(rec.sub_device, 0)
            if size == 0 or size != rec.length_bytes:
                self._forget(journal, rec)  # torn down (a seed of size 0 is not ours)
                continue
            out.append((rec, size))
        return out

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
        if self.backend is None:
            return []
        wanted = set(lease_ids)
        deleted: list[str] = []
        with self._lock:
            records = [r for r in self._records(journal).values() if r.lease_id in wanted]
            for rec, _size in self._untied(records, tied, journal):
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
                    "deleted leftover sub-device %s of ended lease %s", rec.sub_device, rec.lease_id
                )
                self._forget(journal, rec)
                self._first_seen.pop((rec.region_id, rec.sub_device, rec.lease_id), None)
                deleted.append(rec.sub_device)
        return deleted
