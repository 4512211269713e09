"""Has poold already answered this request? Remembered request ids make retries idempotent.

An agent names each grant and each op batch with a request id and sends the same
id again when it did not get the reply (a timeout, a poold killed mid-request,
another poold behind the balancer). The answer is stored in the transaction that
made the change (`remember`), so either both commit or neither; a repeated id from
the same host is answered from the stored row (`recall`) and changes nothing. A
writer's first attempt does not ask (`unless_answered`: a retry is rare, and is
found all the same, at the stored row's unique key or at a refusal), so a retry costs
a run of the request that rolls back, counted as a rerun (`request_id`).

Two poolds receiving the same retry at once both run it; the unique constraint on
(host_id, request_id) lets only one commit. The other's insert fails
(`is_duplicate`), its transaction rolls back, and its rerun finds the winner's
answer. A request that failed with an error stored nothing: its retry runs anew.

Rows are forgotten after the reaper's retention (`forget_older_than`): far longer
than any agent retries one request.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, select
from sqlalchemy.exc import IntegrityError

from poold.errors import BadRequest, PoolError
from poold.ledger import transitions
from poold.ledger.db import Ledger, Prepared
from poold.ledger.models import AgentRequest
from poold.ledger.types import utcnow

GRANT = "grant"
OPS = "ops"

_RECALL = Prepared(
    select(AgentRequest.kind, AgentRequest.response).where(
        AgentRequest.host_id == bindparam("host_id"),
        AgentRequest.request_id == bindparam("request_id"),
    )
)
# What `remember` writes (and poold/ledger/grant_write.py, in a grant's one statement).
REQUEST_COLUMNS = ("host_id", "request_id", "kind", "response", "created_at")
_REMEMBER = Prepared(insert(AgentRequest), column_keys=REQUEST_COLUMNS)
_CONSTRAINT = "uq_agent_requests_host_request"


def recall(conn: Connection, host_id: int, request_id: str, kind: str) -> Any | None:
    """The stored answer to this host's request, or None if it was never answered."""
    row = _RECALL.one_or_none(conn, {"host_id": host_id, "request_id": request_id})
    if row is None:
        return None
    if row.kind != kind:
        raise BadRequest(
            f"request id {request_id!r} already named a {row.kind} request of this host",
            request_id=request_id,
        )
    return row.response


def remember(conn: Connection, host_id: int, request_id: str, kind: str, response: Any) -> None:
    """Store the answer in the caller's transaction (which then commits with it, or not)."""
    _REMEMBER.write(
        conn,
        {
            "host_id": host_id,
            "request_id": request_id,
            "kind": kind,
            "response": response,
            "created_at": utcnow(),
        },
    )


class Answered(Exception):
    """The request was answered before (`unless_answered`): raised out of the
    transaction, so that what its rerun wrote rolls back; the caller answers
    ``stored``."""

    def __init__(self, stored: Any) -> None:
        super().__init__("answered before")
        self.stored = stored


@contextmanager
def unless_answered(
    conn: Connection, host_id: int, request_id: str, kind: str, *, rerun: bool
) -> Iterator[None]:
    """Run the request inside, unless it was answered before: then `Answered` with the
    stored answer.

    Asked first on a ``rerun`` only: a round trip on every request, for the rare retry.
    A first attempt that is a retry whose first run committed is found all the same:
    it meets the stored answer's unique key when it remembers its own (`is_duplicate`:
    its rerun asks first), or it is refused on the way (a `PoolError`, e.g. the quota
    its first run took), and this asks then.
    """
    if rerun:
        stored = recall(conn, host_id, request_id, kind)
        if stored is not None:
            raise Answered(stored)
    try:
        yield
    except PoolError:
        stored = recall(conn, host_id, request_id, kind)
        if stored is None:
            raise
        raise Answered(stored) from None


def is_duplicate(exc: IntegrityError) -> bool:
    """A concurrent run of the same request committed first (the unique constraint)."""
    words = str(exc.orig)
    # PostgreSQL names the constraint; SQLite names the columns.
    return _CONSTRAINT in words or "agent_requests.request_id" in words


def forget_older_than(ledger: Ledger, cutoff: datetime, *, limit: int = 10_000) -> int:
    """Delete remembered answers created before `cutoff`, at most `limit`; how many."""
    oldest = (
        select(AgentRequest.id)
        .where(AgentRequest.created_at < cutoff)
        .order_by(AgentRequest.id)
        .limit(limit)
    )

    def attempt() -> int:
        with ledger.write_conn() as conn:
            ids = list(conn.execute(oldest).scalars())
            for chunk in transitions.chunks(ids):
                conn.execute(delete(AgentRequest).where(AgentRequest.id.in_(chunk)))
            return len(ids)

    return transitions.retrying(attempt, what="forgetting request ids")
