"""Which lease writes of an op batch wait for the batch's end, and writing them there.

An agent's op batch commits the leases it granted alone (an INSERT each) and moves the
leases its ops end (an UPDATE each): on PostgreSQL each statement costs poold ~80 µs of
CPU in the driver, most of its CPU per lease under delegation. Held here, the inserts
go as one statement and the moves as another (`granting.INSERT_LEASES`, `_moves`), written
before anything in the batch reads the leases table again (`flush`: the batch's local
use, a quota read, an overlap check, a lease read a second time, a conditional move of
its own) and at its end, inserts first.

Sound because nothing else writes these rows meanwhile: the leases a batch acts on are
locked up front (poold/ledger/local_commit.py `BatchReads.for_batch`), and the rows it
inserts are its own until it commits; every move is still conditional on the state the
batch read (`WHERE state = expected`), and one that finds fewer rows than it moves
reruns the batch (`transitions.LostRace`). The exclusion constraint still checks every
inserted row, as live: a lease inserted over the bytes of one held here (an agent's
reuse of its tenant's released extent) writes what waits first. Only a batch's first
attempt on PostgreSQL holds writes (`holding`); a rerun, and SQLite, write each at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect

from poold.ledger import transitions
from poold.ledger.db import recordset_of, run_json
from poold.ledger.granting import INSERT_LEASES
from poold.ledger.models import Lease


@dataclass
class _Move:
    """A lease's moves in the batch: the state it was read in, the state after its last
    move, and when it ended (None: a live state, its ended_at as it is)."""

    expected: str
    state: str
    ended_at: datetime | None


# Typed as the leases table's own columns (`db.recordset_of`), built once per dialect.
_MOVE_COLUMNS = (
    Lease.id,
    Lease.state.label("expected"),
    Lease.state,
    Lease.ended_at,
)
_moves_sql: dict[str, str] = {}


def _moves(dialect: Dialect) -> str:
    sql = _moves_sql.get(dialect.name)
    if sql is None:
        # The leases table's own column names and types; the moves are the parameter.
        sql = _moves_sql[dialect.name] = (
            "UPDATE leases SET state = t.state, "  # noqa: S608
            "ended_at = coalesce(t.ended_at, leases.ended_at) "
            f"FROM {recordset_of(dialect, _MOVE_COLUMNS)} "
            "WHERE leases.id = t.id AND leases.state = t.expected"
        )
    return sql


class WriteBehind:
    """The lease rows and moves an op batch holds until `flush` (`transitions.move_if`
    hands it a batch's plain moves; poold/ledger/local_commit.py its inserts)."""

    def __init__(self) -> None:
        self.inserts: list[Mapping[str, Any]] = []
        self.moves: dict[str, _Move] = {}  # by lease id
        # (device, start, end) of every lease held here: an insert over one flushes.
        self.extents: list[tuple[int, int, int]] = []

    def insert(self, conn: Connection, row: Mapping[str, Any]) -> None:
        device, start = row["device_id"], row["offset_bytes"]
        end = start + row["length_bytes"]
        if any(d == device and s < end and start < e for d, s, e in self.extents):
            self.flush(conn)
        self.inserts.append(row)
        self.extents.append((device, start, end))

    @staticmethod
    def can_hold(lease: Any) -> bool:
        """Whether a move of ``lease`` (the row `move_if` was given) can wait: the lease
        as the batch read it, with its extent (poold/ledger/held_lease.py `Held`)."""
        return all(hasattr(lease, k) for k in ("device_id", "offset_bytes", "length_bytes"))

    def move(
        self,
        lease_id: str,
        lease: Any,
        expected: str,
        state: str,
        ended_at: datetime | None,
    ) -> None:
        """The lease from ``expected`` to ``state`` (ended at ``ended_at``; None: live);
        a later move of the same lease continues from there."""
        held = self.moves.get(lease_id)
        if held is None:
            self.moves[lease_id] = _Move(expected, state, ended_at)
            start = lease.offset_bytes
            self.extents.append((lease.device_id, start, start + lease.length_bytes))
            return
        if held.state != expected:  # not what this batch left it in: a bug, not a race
            raise AssertionError(f"lease {lease_id} moved from {expected}, held at {held.state}")
        held.state = state
        held.ended_at = ended_at or held.ended_at

    def flush(self, conn: Connection) -> None:
        """Write what is held: the inserts, then the moves."""
        if self.inserts:
            INSERT_LEASES.write(conn, self.inserts)
            self.inserts = []
        if self.moves:
            rows = [
                {"id": lease_id, "expected": m.expected, "state": m.state, "ended_at": m.ended_at}
                for lease_id, m in self.moves.items()
            ]
            moved = run_json(conn, _moves(conn.dialect), rows)
            self.moves = {}
            if moved != len(rows):
                raise transitions.LostRace("leases")
        self.extents = []


def held(conn: Connection) -> WriteBehind | None:
    """The write-behind of the op batch running on ``conn``, if it holds writes."""
    found = conn.info.get(transitions.MOVES_HELD)
    return found if isinstance(found, WriteBehind) else None


def flush(conn: Connection) -> None:
    """Write what the batch on ``conn`` holds (nothing held: nothing to do)."""
    found = held(conn)
    if found is not None:
        found.flush(conn)


@contextmanager
def holding(conn: Connection, *, hold: bool) -> Iterator[None]:
    """Inside: lease inserts and moves of the batch on ``conn`` wait for its end
    (``hold``: this attempt may; else nothing changes); written when it ends well."""
    if not hold or transitions.MOVES_HELD in conn.info:
        yield
        return
    behind = WriteBehind()
    # The dict itself at the end, as `transitions.events_at_end` keeps it: a connection
    # the database dropped inside is invalidated, and its info raises then.
    info = conn.info
    info[transitions.MOVES_HELD] = behind
    try:
        yield
    finally:
        info.pop(transitions.MOVES_HELD, None)
    behind.flush(conn)
