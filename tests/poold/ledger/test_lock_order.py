"""Do the reaper's hold and an agent's release batch deadlock? On PostgreSQL.

The hold pushes every active lease of a silent host in one transaction; a release
batch of the same host ends some of them in another. Each used to lock the rows in
its own order (the UPDATE's scan order, the outbox order), and PostgreSQL broke the
cycle by aborting one, which reached the agent as `internal`. Now both lock in lease
id order, and a deadlock that still happens is retried inside the ledger: the race,
run many times with the batch in reverse id order, never reaches either caller.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import pytest
from sqlalchemy import select

from poold.ledger import leases
from poold.ledger.db import Ledger
from poold.ledger.models import Host, Lease
from poold.ledger.reaper import Reaper, ReaperPolicy
from poold.ledger.types import utcnow
from poold.wire.agent import GrantRequest, LeaseOp
from tests.poold.conftest import UID, MiB, at_once, device, seed

pytestmark = pytest.mark.postgres

ITERATIONS = 200
LEASES = 24


def test_hold_and_release_batch_never_fail(ledger: Ledger) -> None:
    if ledger.is_sqlite:
        pytest.skip("SQLite runs one writer at a time: it cannot deadlock")
    seed(ledger, devices=[device(capacity_bytes=1 << 40)], quota_bytes=1 << 45, quota_leases=10**6)
    with ledger.read() as s:
        host_id = int(s.scalar(select(Host.id)) or 0)
    reaper = Reaper(ledger, ReaperPolicy())
    req = GrantRequest(tenant="t1", size_bytes=2 * MiB, uid=UID, pid=1, ttl_s=60, activate=True)
    for iteration in range(ITERATIONS):
        ids = [leases.grant(ledger, "h1", req, "agent:h1").id for _ in range(LEASES)]
        # Release every other lease, highest id first: the opposite of the hold's order.
        ops = [LeaseOp(lease_id=x, op="release") for x in sorted(ids, reverse=True)[::2]]
        try:
            _, released = at_once(
                lambda: reaper.hold_host(host_id, utcnow() + timedelta(hours=1)),
                functools.partial(leases.apply_ops, ledger, "h1", ops, "agent:h1"),
            )
        except AssertionError as exc:
            raise AssertionError(f"iteration {iteration}: {exc}") from None
        assert [getattr(r, "code", None) for r in released] == [None] * len(ops)
    with ledger.read() as s:
        live = s.scalar(
            select(Lease.id).where(Lease.state == "active", Lease.expires_at < utcnow()).limit(1)
        )
    assert live is None
