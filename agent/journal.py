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

import contextlib
import json
import os
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pydantic_core

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
        # Leases granted inside the delegation: an append-only log beside the database
        # (see GrantLog); add, remove, watch and entries cover both.
        self.local = GrantLog(path.parent / GRANT_LOG_NAME)

    def add_local(
        self, entry: Entry, grant_json: str, reservation_id: str, epoch: int, durable: bool
    ) -> int:
        """Journal a local grant (an append; fsynced when ``durable``)."""
        return self.local.grant(entry, grant_json, reservation_id, epoch, durable)

    def add(self, entry: Entry) -> None:
        """Journal a lease, and its sub-device (if any) in the same transaction."""
        if self.local.is_live(entry.lease_id):
            self.local.update(entry)  # a local lease changed (shrink)
            if entry.sub_device is not None and entry.region_id is not None:
                sub = SubDevice(
                    entry.region_id,
                    entry.sub_device,
                    entry.lease_id,
                    entry.length_bytes,
                    time.time(),
                )
                self.note_sub_device(sub)
            return
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
        if self.local.is_live(lease_id):
            self.local.end(lease_id)
            return
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
        local = sorted(self.local.state.entries.values(), key=lambda e: e.lease_id)
        return [Entry(*row) for row in rows] + local

    # --- ended memfd leases still mapped -------------------------------------------------
    def watch(self, watched: Watched) -> None:
        """The lease ended but its memfd is still mapped: its journal row becomes a watch
        row, in one transaction (a crash leaves one or the other, never neither).

        A local lease's entry is in the grant log: it ends there after the watch row is
        written (a crash between leaves both, and the next start re-adopts it)."""
        local = self.local.is_live(watched.lease_id)
        self._watch(watched)
        if local:
            self.local.end(watched.lease_id)

    def _watch(self, watched: Watched) -> None:
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
        self.local.close()
        with self._lock:
            self._db.close()


def journalled_sub_devices(path: Path) -> set[str]:
    """The dax sub-devices the journal at ``path`` names (its leases', its leftovers', its
    local leases'), read without writing anything: the running agent may have it open.

    Raises sqlite3.Error when the database cannot be read.
    """
    db = sqlite3.connect(str(path), isolation_level=None)
    try:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
        names: set[str] = set()
        if "leases" in tables:
            names.update(
                row[0]
                for row in db.execute("SELECT sub_device FROM leases WHERE sub_device IS NOT NULL")
            )
        if "sub_devices" in tables:
            names.update(row[0] for row in db.execute("SELECT sub_device FROM sub_devices"))
    finally:
        db.close()
    local, _ = replay_grant_log(path.parent / GRANT_LOG_NAME)
    names.update(e.sub_device for e in local.entries.values() if e.sub_device)
    return names


# --- local grants: an append-only log ----------------------------------------------------
# Grants made inside the delegation (agent/delegation.py) are journalled by appending one
# line to a file instead of a SQLite transaction: measured here, an os.write of a ~1 KiB
# line costs ~5 us where the SQLite insert (WAL, synchronous=NORMAL) costs ~60-100 us, on
# the path of every lease. The log also keeps each local lease's ops until poold has
# applied them: a release queued while poold is down survives a crash of the agent.
#
# fsync: not for volatile memory (DRAM, CXL DRAM, emulated). A crash of the agent alone
# leaves the page cache, so the line is there at the next start. A crash of the host
# (power) loses the line, but also the memory and every process that held it: the lease
# it named has no holder and no contents, and the reservation it lay in is still the
# host's, so nothing in the ledger is wrong. Persistent media keep their contents over
# a power loss, so a holder may come back for them: those lines are fsynced before the
# fd leaves the agent.
GRANT_LOG_NAME = "local-grants.log"
# Past this size the log is rewritten with only what is still needed.
GRANT_LOG_COMPACT_BYTES = 16 << 20


@dataclass
class GrantLogState:
    """What replaying the log says: the live local leases (journal entries and their
    grants), the ops poold has not applied yet (in order), the highest epoch granted per
    reservation, and the last delegation held (JSON, with the wall time it came)."""

    entries: dict[str, Entry]
    grants: dict[str, str]  # lease id -> LocalGrant JSON
    pending: list[tuple[int, str]]  # (seq, LeaseOp JSON), oldest first
    epochs: dict[str, int]
    delegation: tuple[str, float] | None = None


def replay_grant_log(path: Path) -> tuple[GrantLogState, int]:
    """What the log at ``path`` says, and the highest sequence number in it; reads only.

    Only the :class:`GrantLog` of the agent that journals may write the file (it appends
    to the inode it opened, and compacts by renaming a new file over it): anyone else
    reads it through this.
    """
    state = GrantLogState({}, {}, [], {})
    pending: dict[int, str] = {}
    seq = 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = b""
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash mid-write: nothing after it was acked
        kind = rec.get("k")
        if kind == "g":
            state.entries[rec["id"]] = Entry(**rec["e"])
            state.grants[rec["id"]] = rec["g"]
            pending[rec["s"]] = _local_grant_op(rec["id"], rec["g"])
            res, epoch = rec["r"], rec["n"]
            state.epochs[res] = max(state.epochs.get(res, 0), epoch)
        elif kind == "u" and rec["id"] in state.entries:
            state.entries[rec["id"]] = Entry(**rec["e"])
        elif kind == "o":
            pending[rec["s"]] = rec["op"]
        elif kind == "x":
            state.entries.pop(rec["id"], None)
        elif kind == "a":
            for acked in rec["s"]:
                pending.pop(acked, None)
        elif kind == "n":
            state.epochs[rec["r"]] = max(state.epochs.get(rec["r"], 0), rec["n"])
        elif kind == "d":
            state.delegation = (rec["d"], rec["w"])
        seq = max(seq, int(rec.get("s", 0)) if kind in ("g", "o") else 0)
    state.pending = sorted(pending.items())
    # A lease ended with nothing pending is done; its grant is kept while ops wait.
    waiting = {_op_lease(op) for _, op in state.pending}
    state.grants = {k: v for k, v in state.grants.items() if k in state.entries or k in waiting}
    return state, seq


class GrantLog:
    """The append-only journal of local grants (thread-safe; one write per record)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.state, self._seq = replay_grant_log(path)
        self._fd = -1
        self._size = 0  # of the log file: every append adds its line
        self._dir_unsynced = False  # the log renamed in, its directory not synced since
        self._compacting = False
        self._durable_since = False  # a durable record appended during a compaction
        self._install_locked(self._write_new(self._snapshot_locked()), tail_from=None)

    def _snapshot_locked(self) -> list[bytes]:
        """The lines replay needs to come to the state held now (and no more)."""
        state = self.state
        lines: list[bytes] = []
        for res, epoch in sorted(state.epochs.items()):
            lines.append(_line({"k": "n", "r": res, "n": epoch}))
        if state.delegation is not None:
            lines.append(_line({"k": "d", "d": state.delegation[0], "w": state.delegation[1]}))
        grant_seq = {_op_lease(op): seq for seq, op in state.pending if '"local_grant"' in op}
        for lease_id, grant in state.grants.items():
            entry = state.entries.get(lease_id)
            seq = grant_seq.get(lease_id)
            if seq is None:
                self._seq += 1
                seq = self._seq  # delivered already: acked below
            rec: dict[str, Any] = {"k": "g", "id": lease_id, "g": grant, "s": seq}
            rec.update(_epoch_of(grant))
            rec["e"] = asdict(entry) if entry is not None else _ended_entry(lease_id)
            lines.append(_line(rec))
            if entry is None:
                lines.append(_line({"k": "x", "id": lease_id}))
            if lease_id not in grant_seq:
                lines.append(_line({"k": "a", "s": [seq]}))
        for seq, op in state.pending:
            if '"local_grant"' not in op:
                lines.append(_line({"k": "o", "s": seq, "op": op}))
        return lines

    def _write_new(self, lines: list[bytes]) -> tuple[Path, int]:
        """The compacted log written beside the log, and synced; (its path, its size).
        Outside the lock when the log is in use: the fsync waits for the file system's
        journal (ext4 writes out every dirty block of its transaction: tens of ms under a
        busy log), and every lease the agent grants meanwhile appends."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            size = _write_all(fd, b"".join(lines))
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp, size

    def _install_locked(self, new: tuple[Path, int], tail_from: int | None) -> None:
        """Rename the compacted log over the log. ``tail_from``: the log's size when the
        compacted lines were taken; what was appended since is carried over after them
        (replayed after them, it brings the state to what it is now). The new file is
        opened before anything changes: a failure leaves the log and its fd as they were
        (and the compacted file removed)."""
        tmp, size = new
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            if tail_from is not None and self._fd >= 0:
                with open(f"/proc/self/fd/{self._fd}", "rb") as old:
                    old.seek(tail_from)
                    size += _write_all(fd, old.read())
                if self._durable_since:  # synced in the old log: so in the new one
                    os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._size = fd, size
        self._durable_since = False
        # The rename reaches the disk with the directory: before the next durable line
        # counts on it (`_append`), not here, so volatile media never wait for it.
        self._dir_unsynced = True

    def _compact(self) -> None:
        """Rewrite the log with what replay needs, appends going on meanwhile: the lines
        are taken under the lock, written and synced outside it, and renamed over the log
        under it again with whatever was appended in between."""
        with self._lock:
            if self._compacting or self._fd < 0:
                return
            self._compacting = True
            lines = self._snapshot_locked()
            taken_at = os.fstat(self._fd).st_size  # the file's, whatever was counted
        try:
            new = self._write_new(lines)
            with self._lock:
                if self._fd < 0:  # closed meanwhile: the log stays as it is
                    os.unlink(new[0])
                    return
                self._install_locked(new, tail_from=taken_at)
        finally:
            with self._lock:
                self._compacting = False

    # --- appending ------------------------------------------------------------------
    def _append(self, rec: dict[str, Any], durable: bool = False) -> None:
        line = _line(rec)
        self._size += _write_all(self._fd, line)
        if durable:
            os.fsync(self._fd)  # persistent media: see the note above GRANT_LOG_NAME
            if self._dir_unsynced:  # the log was renamed in since the last durable line
                _sync_dir(self.path.parent)
                self._dir_unsynced = False
            if self._compacting:
                self._durable_since = True

    def grant(
        self, entry: Entry, grant_json: str, reservation_id: str, epoch: int, durable: bool
    ) -> int:
        """Journal a local lease and its ``local_grant`` op; the op's sequence number."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            rec = {
                "k": "g",
                "id": entry.lease_id,
                "g": grant_json,
                "s": seq,
                "r": reservation_id,
                "n": epoch,
                # Its fields are plain values: a copy of them is asdict's answer, without
                # its recursive walk (this runs for every local lease, on the lease path).
                "e": dict(vars(entry)),
            }
            self._append(rec, durable)
            self.state.entries[entry.lease_id] = entry
            self.state.grants[entry.lease_id] = grant_json
            self.state.pending.append((seq, _local_grant_op(entry.lease_id, grant_json)))
            seen = self.state.epochs.get(reservation_id, 0)
            self.state.epochs[reservation_id] = max(seen, epoch)
            return seq

    def update(self, entry: Entry) -> None:
        """The entry of a local lease changed (a shrink)."""
        with self._lock:
            self._append({"k": "u", "id": entry.lease_id, "e": asdict(entry)})
            self.state.entries[entry.lease_id] = entry

    def op(self, lease_id: str, op_json: str) -> int:
        """Journal an op of a local lease before it is queued; its sequence number."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._append({"k": "o", "s": seq, "op": op_json})
            self.state.pending.append((seq, op_json))
            return seq

    def end(self, lease_id: str) -> None:
        """The agent no longer holds the local lease (its ops may still be pending)."""
        with self._lock:
            self._append({"k": "x", "id": lease_id})
            self.state.entries.pop(lease_id, None)

    def acked(self, seqs: list[int]) -> None:
        """poold applied these ops; compacts the log when it has grown large."""
        if not seqs:
            return
        with self._lock:
            self._append({"k": "a", "s": seqs})
            done = set(seqs)
            self.state.pending = [(s, op) for s, op in self.state.pending if s not in done]
            if self._size <= GRANT_LOG_COMPACT_BYTES or self._compacting:
                return
            waiting = {_op_lease(op) for _, op in self.state.pending}
            self.state.grants = {
                k: v
                for k, v in self.state.grants.items()
                if k in self.state.entries or k in waiting
            }
        self._compact()

    def delegation(self, delegation_json: str, received_wall: float) -> None:
        """The delegation held now, so that a restart without poold keeps granting."""
        with self._lock:
            self._append({"k": "d", "d": delegation_json, "w": received_wall})
            self.state.delegation = (delegation_json, received_wall)

    def is_live(self, lease_id: str) -> bool:
        return lease_id in self.state.entries

    def size_bytes(self) -> int:
        with self._lock:
            return self._size

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _write_all(fd: int, data: bytes) -> int:
    """Write all of ``data`` (a write may take less, e.g. on a nearly full disk); its
    length. OSError (ENOSPC) when the file system will take no more."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _line(rec: dict[str, Any]) -> bytes:
    # pydantic's serialiser: compact UTF-8 JSON, about four times json.dumps's speed on a
    # grant's record (one per local lease, on the lease path); read back with json.loads.
    return pydantic_core.to_json(rec) + b"\n"


def _local_grant_op(lease_id: str, grant_json: str) -> str:
    return f'{{"lease_id":{json.dumps(lease_id)},"op":"local_grant","grant":{grant_json}}}'


def _op_lease(op_json: str) -> str:
    return str(json.loads(op_json)["lease_id"])


def _epoch_of(grant_json: str) -> dict[str, Any]:
    grant = json.loads(grant_json)
    return {"r": grant["reservation_id"], "n": grant["epoch"]}


def _ended_entry(lease_id: str) -> dict[str, Any]:
    """A placeholder entry for a lease that ended with ops still pending (not adopted)."""
    return asdict(Entry(lease_id, "", "", 0, 1, 1, 0, 0, None, 1, None, None, "{}"))
