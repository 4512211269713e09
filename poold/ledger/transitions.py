"""How does one writer change a row that other writers may be changing at the same time?

Every ledger write that others race goes through here:

* `compare_and_bump`: the one generation bump (STYLE.md pattern 1),
  `UPDATE … SET generation = :seen + 1 WHERE id = :id AND generation = :seen`.
  False means another writer moved the row first: what the caller read may be
  stale, so it raises `LostRace` and `retrying` runs it again in a fresh
  transaction. `bump` is the same swap for a writer that has already changed what
  the generation guards (a quarantine, a device's state): it locks the row first,
  so its swap cannot lose. A device's generation moves only when bytes are taken
  (a grant, a reservation, a quarantine) or its state or inventory changes, never
  when bytes are freed: a placement made in free space stays valid when more frees
  up, and each grant's own swap keeps epochs growing (docs/design-changes.md
  "Freeing bytes moves no generation").
* `move_if`: the one conditional lease transition, with its `events` row
  (invariant 3) and `ended_at` when the lease stops being live.
* `record` and `event_row`: the one way an `events` row is written, in the
  caller's transaction so that it commits or rolls back with the change.
* `chunks`: IN lists cut to a size SQLite accepts.
* `retrying`: one whole transaction run again when it lost a race, or when the
  database aborted it to resolve contention (a deadlock, a serialisation
  failure, SQLite locked past its busy timeout): every ledger entry point that
  writes runs through it, so contention never reaches a client as `internal`.

Lock order: a transaction that locks several leases locks them by lease id
(`lock_order`), and devices by device id after its leases; two writers that
touch overlapping sets then queue instead of deadlocking.

Core statements only: the grant and release hot paths call these.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, CursorResult, bindparam, insert, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from poold.errors import GenerationConflict, LedgerUnavailable
from poold.lease_states import LIVE_STATE_VALUES, LeaseEvent, LeaseState, next_state
from poold.ledger import news
from poold.ledger.db import InsertRows, Prepared, is_contention, is_stale_connection
from poold.ledger.models import Device, Event, Host, Lease, Tenant
from poold.ledger.types import utcnow

T = TypeVar("T")

# SQLite caps the bound parameters of one statement (32766 since 3.32).
IN_CHUNK = 10_000
MAX_ATTEMPTS = 16
RETRY_BACKOFF_S = 0.002
# A transaction the database aborted for contention runs at most this many times in
# all; the pause before each rerun is random up to CONTENTION_BACKOFF_S * 2**n (capped):
# a deadlock's two victims must not meet again at once.
CONTENTION_ATTEMPTS = 6
CONTENTION_BACKOFF_S = 0.01
CONTENTION_BACKOFF_CAP_S = 0.5

Generational = type[Device] | type[Tenant] | type[Host]


def chunks(items: Sequence[T], size: int = IN_CHUNK) -> Iterator[Sequence[T]]:
    """`items` in slices of at most `size`, for `column.in_(...)` lists."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


# --- the journal ---------------------------------------------------------------------

_INSERT_EVENT = insert(Event)
EVENT_COLUMNS = (
    "at",
    "actor",
    "kind",
    "lease_id",
    "tenant_id",
    "host_id",
    "device_id",
    "from_state",
    "to_state",
    "reason",
    "detail",
)
# The same INSERT on the driver's cursor, for a bare Connection (the lease hot path);
# several rows in one statement.
_INSERT_EVENT_FAST = InsertRows(_INSERT_EVENT, EVENT_COLUMNS)
# Where `record` leaves the kinds of the events a transaction wrote, on a connection
# of an engine that counts them at COMMIT (metrics_views.count_committed_events).
PENDING_EVENTS = "poold.pending_event_kinds"
# Events `record` holds for `events_at_end` (a list, on the connection's info).
_DEFERRED_EVENTS = "poold.deferred_events"


def event_row(
    *,
    actor: str,
    kind: str,
    at: datetime | None = None,
    lease_id: str | None = None,
    tenant_id: int | None = None,
    host_id: int | None = None,
    device_id: int | None = None,
    from_state: str | None = None,
    to_state: str | None = None,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One `events` row for `record`; `at` defaults to now."""
    return {
        "at": at or utcnow(),
        "actor": actor,
        "kind": kind,
        "lease_id": lease_id,
        "tenant_id": tenant_id,
        "host_id": host_id,
        "device_id": device_id,
        "from_state": from_state,
        "to_state": to_state,
        "reason": reason,
        "detail": detail or {},
    }


def record(db: Connection | Session, *rows: dict[str, Any]) -> None:
    """Append `event_row`s in the caller's transaction, in one statement."""
    # One row as a dict, not a list of one: a list takes SQLAlchemy's executemany
    # path, which costs about as much again per event on the lease hot path.
    if not rows:
        return
    if isinstance(db, Connection):
        deferred = db.info.get(_DEFERRED_EVENTS)
        if deferred is not None:
            deferred.extend(rows)
        else:
            _INSERT_EVENT_FAST.write(db, rows)
    elif len(rows) == 1:
        db.execute(_INSERT_EVENT, rows[0])
    else:
        db.execute(_INSERT_EVENT, list(rows))
    noted(db if isinstance(db, Connection) else db.connection(), rows)


def noted(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """What recording events does beside writing them, for a writer that wrote them in
    a statement of its own (poold/ledger/grant_write.py): news, and their count."""
    # What an agent did not do itself (the reaper, an administrator, pressure) is
    # news for the lease's host: its agent is told at commit (poold/ledger/news.py).
    told = {
        row["host_id"]
        for row in rows
        if row["host_id"] is not None and not str(row["actor"]).startswith("agent:")
    }
    if told:
        news.tell(conn, told)
    # Counted when the transaction commits, where an engine counts (metrics_views).
    pending = conn.info.get(PENDING_EVENTS)
    if pending is not None:
        pending.extend(row["kind"] for row in rows)


def deferring_events(conn: Connection) -> bool:
    """Whether `record` on ``conn`` holds its events for `events_at_end`."""
    return _DEFERRED_EVENTS in conn.info


@contextmanager
def events_at_end(conn: Connection) -> Iterator[None]:
    """Write the events `record` appends on `conn` inside this block in one statement
    when it ends, in the order they were recorded.

    For a writer that records an event per item of a batch (an agent's op batch): on
    PostgreSQL each INSERT is a round trip of its own, ~0.1 ms of poold's CPU, and one
    executemany pipelines them. Nothing reads the events table inside such a block.
    On an error nothing is written; the transaction is rolled back anyway."""
    # The dict itself, not `conn.info` again at the end: a connection the database
    # dropped inside the block is invalidated, and reading its info then raises
    # PendingRollbackError instead of the error that says the ledger is unavailable.
    info = conn.info
    if _DEFERRED_EVENTS in info:
        yield
        return
    rows: list[dict[str, Any]] = []
    info[_DEFERRED_EVENTS] = rows
    try:
        yield
    finally:
        info.pop(_DEFERRED_EVENTS, None)
    _INSERT_EVENT_FAST.write(conn, rows)


# --- generations -----------------------------------------------------------------------

_SWAP = {
    model: Prepared(
        update(model)
        .where(model.id == bindparam("row_id"), model.generation == bindparam("seen"))
        .values(generation=bindparam("next_generation"))
    )
    for model in (Device, Tenant, Host)
}
# FOR NO KEY UPDATE (PostgreSQL): the lock an UPDATE of the row takes anyway, so
# locking first adds no conflict (a grant's foreign key on the device still passes).
_LOCK = {
    model: Prepared(
        select(model.generation)
        .where(model.id == bindparam("row_id"))
        .with_for_update(key_share=True)
    )
    for model in (Device, Tenant, Host)
}


class LostRace(Exception):
    """Another writer moved a generation this transaction read; run it again.

    ``row``: the table whose generation swap was lost ("tenants", "devices"...), or
    "constraint" when a concurrent writer's commit met this one at a constraint; what
    `reruns` counts it under."""

    def __init__(self, row: str = "other") -> None:
        super().__init__(row)
        self.row = row


# Reruns of whole transactions in this process, by (cause, row): what an operator
# watches to see writers racing each other (poold_ledger_reruns_total, as PostgreSQL
# counts the deadlocks it broke). Process-wide: one poold has one ledger.
_RERUNS: dict[tuple[str, str], int] = {}
_RERUNS_LOCK = threading.Lock()


def reruns() -> dict[tuple[str, str], int]:
    """How many transactions `retrying` ran again in this process, by (cause, row)."""
    with _RERUNS_LOCK:
        return dict(_RERUNS)


def _rerun(cause: str, row: str = "") -> None:
    with _RERUNS_LOCK:
        _RERUNS[cause, row] = _RERUNS.get((cause, row), 0) + 1


def swap_or_rerun(conn: Connection, model: Generational, row_id: int, seen: int) -> None:
    """`compare_and_bump`, or `LostRace` naming the row's table when the swap is lost."""
    if not compare_and_bump(conn, model, row_id, seen):
        raise LostRace(model.__tablename__)


def swap_all_or_rerun(conn: Connection, model: Generational, seen: Mapping[int, int]) -> None:
    """`swap_or_rerun` of several rows (id -> the generation read) in one executemany, in
    the mapping's order; any swap lost is `LostRace` (nothing of the transaction commits).
    For a writer that locked the rows in the ledger's order first: its swaps then cannot
    lose, and one round trip replaces one per row."""
    if not seen:
        return
    params = [{"row_id": i, "seen": g, "next_generation": g + 1} for i, g in seen.items()]
    if _SWAP[model].write(conn, params) != len(params):
        raise LostRace(model.__tablename__)


def compare_and_bump(
    conn: Connection, model: Generational, row_id: int, seen: int, **values: Any
) -> bool:
    """Move the row from generation `seen` to `seen + 1` (setting `values` with it).

    False when its generation is no longer `seen`: another writer changed the row
    since the caller read it, and nothing was written.
    """
    if values:
        stmt = (
            update(model)
            .where(model.id == row_id, model.generation == seen)
            .values(generation=seen + 1, **values)
        )
        result: CursorResult[Any] = conn.execute(stmt)
        return result.rowcount == 1
    params = {"row_id": row_id, "seen": seen, "next_generation": seen + 1}
    return _SWAP[model].write(conn, params) == 1


def bump(conn: Connection, model: Generational, row_id: int) -> int:
    """Bump the row's generation whatever it is now; its new generation.

    For a writer that already changed what the generation guards in this
    transaction (a quarantine, a state change): any grant that read the row
    before this commits then loses its own swap and reads again. The row lock
    taken first means no other writer can move the generation in between.
    """
    seen = _LOCK[model].rows(conn, {"row_id": row_id})[0][0]
    if not compare_and_bump(conn, model, row_id, seen):
        raise GenerationConflict(f"{model.__tablename__} {row_id} changed under its row lock")
    return int(seen) + 1


def retrying(run: Callable[[], T], *, what: str, attempts: int = MAX_ATTEMPTS) -> T:
    """`run()` (one whole transaction) until it neither loses a race nor is aborted for
    contention, a bounded number of times.

    A stale generation met inside the ledger is retried here, never sent to the
    client; only one that keeps losing becomes `generation_conflict` (409). A
    deadlock or serialisation failure (or SQLite's "database is locked") is retried
    up to CONTENTION_ATTEMPTS times with a jittered, growing pause; past that it is
    `ledger_unavailable` (503, retryable). Nothing of a failed attempt committed.
    """
    lost = contended = stale = 0
    while True:
        try:
            return run()
        except LostRace as race:
            lost += 1
            if lost >= attempts:
                raise GenerationConflict(f"{what} lost {attempts} races in a row; retry") from None
            _rerun("lost_race", race.row)
            # Writers that lost the same race retry at once and collide again;
            # a short, growing, random pause spreads them out.
            time.sleep(random.uniform(0, RETRY_BACKOFF_S * lost))  # noqa: S311
        except (LedgerUnavailable, DBAPIError) as exc:
            if is_stale_connection(exc) and stale == 0:
                # A pooled connection found dead before anything was sent: once, at
                # once, on a fresh one (poold/ledger/db.py `make_engine`).
                stale += 1
                _rerun("stale_connection")
                continue
            if not is_contention(exc):
                raise
            contended += 1
            if contended >= CONTENTION_ATTEMPTS:
                if isinstance(exc, LedgerUnavailable):
                    raise
                raise LedgerUnavailable(
                    f"{what} was aborted by the database {contended} times in a row "
                    "(deadlock or serialisation failure); retry",
                    reason="contention",
                ) from exc
            _rerun("contention")
            pause = min(CONTENTION_BACKOFF_CAP_S, CONTENTION_BACKOFF_S * 2**contended)
            time.sleep(random.uniform(0, pause))  # noqa: S311


def lock_order(lease_ids: Iterable[str]) -> list[str]:
    """The order in which one transaction locks several leases: by id, each once."""
    return sorted(set(lease_ids))


def update_leases(db: Connection | Session, where: Sequence[Any], values: dict[str, Any]) -> int:
    """`UPDATE leases SET values WHERE where` for many leases, locking them in id order; how
    many rows changed.

    One UPDATE locks its rows in whatever order the plan visits them; a writer
    locking some of the same leases in id order can then deadlock with it.
    `SELECT … ORDER BY id FOR UPDATE` takes the locks in id order first (PostgreSQL;
    SQLite has one writer and ignores FOR UPDATE), then the rows are updated in chunks.
    """
    ids = list(
        db.execute(select(Lease.id).where(*where).order_by(Lease.id).with_for_update()).scalars()
    )
    changed = 0
    for chunk in chunks(ids):
        result = db.execute(
            update(Lease)
            .where(Lease.id.in_(chunk), *where)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        changed += int(result.rowcount)  # type: ignore[attr-defined]
    return changed


# --- lease transitions -----------------------------------------------------------------

# Where an op batch's write-behind (poold/ledger/write_behind.py) sits on its connection:
# `move_if` hands it the plain moves, and writes what it holds before any other.
MOVES_HELD = "poold.moves_held"

_MOVE_WHERE = (Lease.id == bindparam("move_id"), Lease.state == bindparam("move_expected"))
_MOVE_LIVE = Prepared(update(Lease).where(*_MOVE_WHERE).values(state=bindparam("state")))
_MOVE_ENDED = Prepared(
    update(Lease)
    .where(*_MOVE_WHERE)
    .values(state=bindparam("state"), ended_at=bindparam("ended_at"))
)
_LEASE_IDS = select(Lease.tenant_id, Lease.host_id, Lease.device_id).where(
    Lease.id == bindparam("lease_id")
)


def move_if(
    conn: Connection,
    lease_id: str,
    expected: LeaseState,
    event: LeaseEvent,
    *,
    actor: str,
    reason: str | None,
    now: datetime,
    where: Iterable[Any] = (),
    values: dict[str, Any] | None = None,
    detail: dict[str, Any] | None = None,
    lease: Any = None,
) -> bool:
    """Move a lease from `expected` along `event`, with its event; False if it lost a race.

    `UPDATE … WHERE id = :id AND state = :expected [AND where…]` touches no row
    when another writer (a second poold's reaper, the holder releasing, an
    admin) moved the lease first; then nothing is written, so concurrent writers
    never journal a transition twice. `where` carries the reason's own condition
    (e.g. `expires_at <= now`) so that a renewal landing between the caller's
    read and this write wins. An event the state machine refuses raises before
    anything is written.

    `lease`: a row the caller already read with the lease's tenant_id, host_id
    and device_id (saves a query).
    """
    after = next_state(expected, event)
    behind = conn.info.get(MOVES_HELD)
    if behind is not None and (where or values or not behind.can_hold(lease)):
        behind.flush(conn)  # this move reads the row as the batch left it
        behind = None
    if lease is None:
        lease = conn.execute(_LEASE_IDS, {"lease_id": lease_id}).one_or_none()
        if lease is None:
            return False
    changes: dict[str, Any] = {"state": after.value, **(values or {})}
    ended = after.value not in LIVE_STATE_VALUES
    if ended:
        changes["ended_at"] = now
    if behind is not None:
        # Held for the batch's end (checked there: write_behind.WriteBehind.flush).
        behind.move(lease_id, lease, expected.value, after.value, now if ended else None)
        changed = 1
    elif not where and not values:
        # The common move, as a statement built once: building an UPDATE costs
        # tens of microseconds of Python per call (and its cache key as much again).
        changed = (_MOVE_ENDED if ended else _MOVE_LIVE).write(
            conn, {"move_id": lease_id, "move_expected": expected.value, **changes}
        )
    else:
        changed = conn.execute(
            update(Lease)
            .where(Lease.id == lease_id, Lease.state == expected.value, *where)
            .values(**changes)
        ).rowcount
    if changed != 1:
        return False
    if after is not expected:  # a renewal-like self-loop changes no state: no event
        record(
            conn,
            event_row(
                at=now,
                actor=actor,
                kind=f"lease.{event.value}",
                lease_id=lease_id,
                tenant_id=lease.tenant_id,
                host_id=lease.host_id,
                device_id=lease.device_id,
                from_state=expected.value,
                to_state=after.value,
                reason=reason or None,
                detail=detail,
            ),
        )
    return True
