"""What did the agent hand out before it restarted? A small local SQLite journal.

One row per live lease: where its memory is (device, range, sub-device), who
holds it (pid + start time) and for how long. Written before the fd leaves the
agent and deleted when the lease ends, so after a crash or restart the agent
can re-adopt leases whose holders are alive and clean up the rest.
"""

from __future__ import annotations

import sqlite3
import threading
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
    lease_json TEXT NOT NULL
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

    def add(self, entry: Entry) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO leases VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
                ),
            )

    def remove(self, lease_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,))

    def entries(self) -> list[Entry]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM leases ORDER BY lease_id").fetchall()
        return [Entry(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
