"""What a central grant writes, and on PostgreSQL in one statement.

A grant writes seven things once it has placed the lease: the swaps of the host's,
the device's and the tenant's generations, the lease, its events and (for a request
with an id) the answer a retry gets. Sent one by one, each is a round trip costing
~0.13 ms of poold's CPU on PostgreSQL (psycopg's work per statement, not the
server's): half of a grant's ledger time. On PostgreSQL they are one statement of
data-modifying CTEs instead.

The order the separate statements kept is kept by data dependencies: each swap's
WHERE reads the RETURNING of the one before it, and the inserts read the tenant's. So
the host's row is locked before the device's and the device's before the tenant's
(the heartbeat's order, poold/ledger/leases.py), and the lease reaches the exclusion
constraint only while its device row is held (two grants of one range queue at the
device, rather than deadlock at the constraint). A lost swap leaves every later part
without a row to act on: nothing is written, and the statement's counts name the
first swap lost. On SQLite (one writer at a time, ~10 µs a statement) the statements
stay separate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import (
    JSON,
    Connection,
    Text,
    bindparam,
    cast,
    column,
    exists,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.sql.selectable import CTE

from poold.ledger import agent_requests, granting, transitions
from poold.ledger.db import Prepared, json_rows
from poold.ledger.models import AgentRequest, Device, Event, Host, Lease, Tenant

# The swaps in the order they lock (host, device, tenant), as (model, CTE name).
_SWAPS: tuple[tuple[Any, str], ...] = ((Host, "h"), (Device, "d"), (Tenant, "t"))


def _swap(model: Any, name: str, after: CTE | None) -> CTE:
    where = [model.id == bindparam(f"{name}_id"), model.generation == bindparam(f"{name}_seen")]
    if after is not None:
        where.append(exists(select(after.c.id)))
    return (
        update(model)
        .where(*where)
        .values(generation=bindparam(f"{name}_next"))
        .returning(model.id)
        .cte(name)
    )


def _typed(table: Any, columns: Sequence[str], prefix: str) -> list[Any]:
    """A SELECT list of bind parameters typed as ``table``'s columns."""
    return [bindparam(f"{prefix}{c}", type_=table.c[c].type).label(c) for c in columns]


def _statement(remember: bool) -> Prepared:
    swaps: list[CTE] = []
    for model, name in _SWAPS:
        swaps.append(_swap(model, name, swaps[-1] if swaps else None))
    table = Lease.__table__
    lease_cols = list(granting.NEW_LEASE_COLUMNS)
    # The columns a new lease takes the model's defaults for, as INSERT_LEASE gives them.
    defaults = [c for c in table.c if c.key not in lease_cols and c.default is not None]
    if not all(c.default.is_scalar for c in defaults):
        raise ValueError("a lease column's default is not a value: give it in NEW_LEASE_COLUMNS")
    values = _typed(table, lease_cols, "lease_")
    values += [literal(c.default.arg, type_=c.type).label(c.key) for c in defaults]
    lease = (
        insert(Lease)
        .from_select(
            [*lease_cols, *(c.key for c in defaults)],
            select(*values).where(exists(select(swaps[-1].c.id))),
            include_defaults=False,
        )
        .returning(Lease.id)
        .cte("l")
    )
    written = exists(select(lease.c.id))
    event_cols = list(transitions.EVENT_COLUMNS)
    rows = (
        func.json_to_recordset(cast(bindparam("events", type_=Text), JSON))
        .table_valued(*[column(c, Event.__table__.c[c].type) for c in event_cols])
        .render_derived(with_types=True)
    )
    events = (
        insert(Event)
        .from_select(event_cols, select(*[rows.c[c] for c in event_cols]).where(written))
        .cte("e")
    )
    extra = [events]
    if remember:
        cols = list(agent_requests.REQUEST_COLUMNS)
        extra.append(
            insert(AgentRequest)
            .from_select(cols, select(*_typed(AgentRequest.__table__, cols, "req_")).where(written))
            .cte("r")
        )
    counts = [
        select(func.count()).select_from(c).scalar_subquery().label(c.name) for c in (*swaps, lease)
    ]
    return Prepared(select(*counts).add_cte(*extra))


_ONE_STATEMENT = {remember: _statement(remember) for remember in (False, True)}


def write(
    conn: Connection,
    swaps: Sequence[int],
    seen: Sequence[int],
    lease: Mapping[str, Any],
    events: Sequence[dict[str, Any]],
    answer: tuple[int, str, Any] | None,
) -> None:
    """Swap the generations (``swaps``: the host's, device's and tenant's ids; ``seen``:
    the generations read), insert ``lease`` and ``events``, and remember ``answer``
    ((host id, request id, response) of a grant request) — or `transitions.LostRace`
    naming the first swap lost, with nothing written."""
    # Its events go in the statement: not for a caller deferring them (events_at_end).
    assert not transitions.deferring_events(conn)
    if conn.dialect.name != "postgresql":
        for (model, _name), row_id, generation in zip(_SWAPS, swaps, seen, strict=True):
            transitions.swap_or_rerun(conn, model, row_id, generation)
        granting.INSERT_LEASE.write(conn, lease)
        transitions.record(conn, *events)
        if answer is not None:
            agent_requests.remember(conn, answer[0], answer[1], agent_requests.GRANT, answer[2])
        return
    params: dict[str, Any] = {f"lease_{k}": v for k, v in lease.items()}
    for (_model, name), row_id, generation in zip(_SWAPS, swaps, seen, strict=True):
        params.update({f"{name}_id": row_id, f"{name}_seen": generation})
        params[f"{name}_next"] = generation + 1
    params["events"] = json_rows(events)
    if answer is not None:
        host_id, request_id, response = answer
        params.update(
            req_host_id=host_id,
            req_request_id=request_id,
            req_kind=agent_requests.GRANT,
            req_response=response,
            req_created_at=lease["granted_at"],
        )
    counts = _ONE_STATEMENT[answer is not None].rows(conn, params)[0]
    for (model, _name), n in zip(_SWAPS, counts, strict=False):
        if n != 1:
            raise transitions.LostRace(model.__tablename__)
    transitions.noted(conn, events)
