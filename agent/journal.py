"""What did the agent hand out before it restarted? A small local SQLite journal.

One row per live lease: where its memory is (device, range, sub-device), who
holds it (pid + start time) and for how long. Written before the fd leaves the
agent and deleted when the lease ends, so after a crash or restart the agent
can re-adopt leases whose holders are alive and clean up the rest.

A third table, ``mapped``, keeps the memfd leases that ended while some process still
mapped or held the memfd, by inode, until none does (agent/mappings.py), so that a
restarted agent keeps watching them and their bytes stay counted.

A second table keeps every dax sub-device the agent made for a lease, and the
temporary one a scrub makes over a released lease's range (under that lease's
id, written before the sub-device is sized, deleted with it). A row outlives
its lease: it goes only once the sub-device is seen gone, so a sub-device whose
teardown failed (or never ran: the agent was killed between release and
teardown, or in the middle of a scrub) is still known, with its lease: the next
start destroys it, or the audit finds it (agent/leftovers.py).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    device_uid TEXT NOT NULL,
    backend TEXT NOT NULL,
    offset_bytes INTEGER NOT NULL,
    length_bytes INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    holder_pid INTEGER NOT NULL,
    holder_uid INTEGER NOT NULL,
    holder_start REAL,
    ttl_s INTEGER NOT NULL,
    sub_device TEXT,
    region_id INTEGER,
    lease_json TEXT NOT NULL,
    st_dev INTEGER,
    st_ino INTEGER
)
"""
# Columns added after the first journals were written: (name, SQL type).
LEASE_COLUMNS_ADDED = (("st_dev", "INTEGER"), ("st_ino", "INTEGER"))

# Ended memfd leases whose memfd some process still maps or holds (agent/mappings.py):
# watched by inode (no fd needed) until none does, across agent restarts.
MAPPED_SCHEMA = """
CREATE TABLE IF NOT EXISTS mapped (
    lease_id TEXT PRIMARY KEY,
    st_dev INTEGER NOT NULL,
    st_ino INTEGER NOT NULL,
    length_bytes INTEGER NOT NULL,
    holder_uid INTEGER NOT NULL,
    why TEXT NOT NULL,
    since REAL NOT NULL
)
"""

SUB_DEVICES_SCHEMA = """
CREATE TABLE IF NOT EXISTS sub_devices (
    region_id INTEGER NOT NULL,
    sub_device TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    length_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (region_id, sub_device)
)
"""


@dataclass(frozen=True)
class Entry:
    lease_id: str
    device_uid: str
    backend: str
    offset_bytes: int
    length_bytes: int
    epoch: int
    holder_pid: int
    holder_uid: int
    holder_start: float | None
    ttl_s: int
    sub_device: str | None
    region_id: int | None
    lease_json: str
    # The memfd's inode (agent/mappings.py), for memfd leases; None for a dax sub-device.
    st_dev: int | None = None
    st_ino: int | None = None


@dataclass(frozen=True)
class Watched:
    """An ended memfd lease still mapped or held by some process, watched by its inode."""

    lease_id: str
    st_dev: int
    st_ino: int
    length_bytes: int
    holder_uid: int
    why: str  # how it ended: released, revoked, orphaned
    since: float  # seconds since the epoch: when it ended for its holder


@dataclass(frozen=True)
class SubDevice:
    """A dax sub-device the agent made for a lease or its scrub (the kernel names it; a
    name is reused only after the sub-device it named was deleted)."""

    region_id: int
    sub_device: str  # "dax0.3"
    lease_id: str
    length_bytes: int
    created_at: float  # seconds since the epoch


class Journal:
    """Thread-safe; every write is its own committed transaction (WAL, synchronous=NORMAL)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(SCHEMA)
        self._db.execute(SUB_DEVICES_SCHEMA)  # journals made before it get it here
        self._db.execute(MAPPED_SCHEMA)  # likewise
        have = {row[1] for row in self._db.execute("PRAGMA table_info(leases)")}
        for name, sql_type in LEASE_COLUMNS_ADDED:
            if name not in have:
                self._db.execute(f"ALTER TABLE leases ADD COLUMN {name} {sql_type}")

    def add(self, entry: Entry) -> None:
        """Journal a lease, and its sub-device (if any) in the same transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._insert(entry)
                if entry.sub_device is not None and entry.region_id is not None:
                    self._note(
                        SubDevice(
                            entry.region_id,
                            entry.sub_device,
                            entry.lease_id,
                            entry.length_bytes,
                            time.time(),
                        )
                    )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _insert(self, entry: Entry) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO leases (lease_id, device_uid, backend, offset_bytes, "
            "length_bytes, epoch, holder_pid, holder_uid, holder_start, ttl_s, sub_device, "
            "region_id, lease_json, st_dev, st_ino) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                entry.lease_id,
                entry.device_uid,
                entry.backend,
                entry.offset_bytes,
                entry.length_bytes,
                entry.epoch,
                entry.holder_pid,
                entry.holder_uid,
                entry.holder_start,
                entry.ttl_s,
                entry.sub_device,
                entry.region_id,
                entry.lease_json,
                entry.st_dev,
                entry.st_ino,
            ),
        )

    def remove(self, lease_id: str) -> None:
        """The lease ended; its sub-device row stays until the sub-device is seen gone."""
        with self._lock:
            self._db.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,))

    def _note(self, sub: SubDevice) -> None:
        # Keyed by (region, name): a name the kernel reused belongs to the newer lease.
        self._db.execute(
            "INSERT OR REPLACE INTO sub_devices VALUES (?,?,?,?,?)",
            (sub.region_id, sub.sub_device, sub.lease_id, sub.length_bytes, sub.created_at),
        )

    def note_sub_device(self, sub: SubDevice) -> None:
        """Remember a sub-device made for a lease, or for its scrub (Journal.add does it for
        journalled leases)."""
        with self._lock:
            self._note(sub)

    def sub_devices(self) -> list[SubDevice]:
        with self._lock:
            rows = self._db.execute(
                "SELECT region_id, sub_device, lease_id, length_bytes, created_at "
                "FROM sub_devices ORDER BY region_id, sub_device"
            ).fetchall()
        return [SubDevice(*row) for row in rows]

    def forget_sub_device(self, sub: SubDevice) -> None:
        """The sub-device is gone; a row a newer lease took over (same name) stays."""
        with self._lock:
            self._db.execute(
                "DELETE FROM sub_devices WHERE region_id = ? AND sub_device = ? AND lease_id = ?",
                (sub.region_id, sub.sub_device, sub.lease_id),
            )

    def entries(self) -> list[Entry]:
        with self._lock:
            rows = self._db.execute(
                "SELECT lease_id, device_uid, backend, offset_bytes, length_bytes, epoch, "
                "holder_pid, holder_uid, holder_start, ttl_s, sub_device, region_id, "
                "lease_json, st_dev, st_ino FROM leases ORDER BY lease_id"
            ).fetchall()
        return [Entry(*row) for row in rows]

    # --- ended memfd leases still mapped -------------------------------------------------
    def watch(self, watched: Watched) -> None:
        """The lease ended but its memfd is still mapped: its journal row becomes a watch
        row, in one transaction (a crash leaves one or the other, never neither)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM leases WHERE lease_id = ?", (watched.lease_id,))
                self._db.execute(
                    "INSERT OR REPLACE INTO mapped VALUES (?,?,?,?,?,?,?)",
                    (
                        watched.lease_id,
                        watched.st_dev,
                        watched.st_ino,
                        watched.length_bytes,
                        watched.holder_uid,
                        watched.why,
                        watched.since,
                    ),
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def unwatch(self, lease_id: str) -> None:
        """No process maps or holds the memfd any more."""
        with self._lock:
            self._db.execute("DELETE FROM mapped WHERE lease_id = ?", (lease_id,))

    def watched(self) -> list[Watched]:
        with self._lock:
            rows = self._db.execute(
                "SELECT lease_id, st_dev, st_ino, length_bytes, holder_uid, why, since "
                "FROM mapped ORDER BY lease_id"
            ).fetchall()
        return [Watched(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
