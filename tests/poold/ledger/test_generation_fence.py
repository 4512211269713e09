"""Do a device drain, a host drain and a tenant quota cut fence out racing grants? On PostgreSQL.

Many threads grant leases, each grant its own transaction, while the main thread
drains the device they land on, or cuts their tenant's quota to what it already
holds. Once the drain (or the cut) has committed, no grant may commit on the old
state: every grant bumps the device and tenant generations it read with a
compare-and-swap, and so must the drain and the cut, or a grant that read the
generation they overwrote passes its own swap after them (STYLE.md pattern 1).

What is checked, every iteration:

* no bump is lost: the generation moved by exactly one per successful grant, plus
  one for the drain or the cut;
* the drain's bump is the device's last: every lease of the iteration has an
  epoch (the device generation its grant swapped to) below the final generation;
* nothing committed after the drain or cut did: a lease that a read made right
  after it returned did not see is a grant the fence let through.

SQLite runs one writer at a time (BEGIN IMMEDIATE): no bump can be lost there, so
the race is run on PostgreSQL only.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
from sqlalchemy import select

from poold.errors import PoolError
from poold.ledger import draining, leases, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import Device, Host, Lease, Tenant
from poold.wire.admin import TenantUpdate
from poold.wire.agent import GrantRequest
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, device, seed

pytestmark = pytest.mark.postgres

T = TypeVar("T")

ITERATIONS = 40
THREADS = 6
LEASE_BYTES = 2 * MiB
# Plenty of room: only the drain or the quota cut may stop a grant.
CAPACITY_BYTES = 1 << 40
ROOMY_QUOTA_BYTES = 1 << 45


def skip_sqlite(ledger: Ledger) -> None:
    if ledger.is_sqlite:
        pytest.skip("SQLite serialises writers (BEGIN IMMEDIATE): no bump can be lost there")


def seeded(ledger: Ledger) -> None:
    seed(
        ledger,
        devices=[device(capacity_bytes=CAPACITY_BYTES)],
        quota_bytes=ROOMY_QUOTA_BYTES,
        quota_leases=1_000_000,
    )


@contextmanager
def granting(ledger: Ledger) -> Iterator[list[LeaseOut]]:
    """Threads granting leases as fast as they can until the block ends; what they got."""
    stop = threading.Event()
    granted: list[LeaseOut] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        req = GrantRequest(
            tenant="t1", size_bytes=LEASE_BYTES, uid=UID, pid=n, ttl_s=3600, activate=True
        )
        try:
            while not stop.is_set():
                try:
                    out = leases.grant(ledger, "h1", req, f"agent:race{n}")
                except PoolError:
                    # no_capacity once drained, quota_exceeded once cut, or a lost race
                    time.sleep(0.001)
                    continue
                with lock:
                    granted.append(out)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    try:
        yield granted
    finally:
        # Grants that read the old state just before the change may still be in flight.
        time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def wait_for_grants(granted: list[LeaseOut], at_least: int) -> None:
    """Let the grants get going, then a little more (so the change lands at random)."""
    deadline = time.monotonic() + 10
    while len(granted) < at_least and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(random.uniform(0, 0.01))  # noqa: S311


def generation(ledger: Ledger, model: type[Device] | type[Tenant] | type[Host]) -> int:
    with ledger.read() as s:
        return int(s.scalar(select(model.generation)) or 0)


def lease_ids(ledger: Ledger) -> set[str]:
    with ledger.read() as s:
        return set(s.scalars(select(Lease.id)))


def race(ledger: Ledger, change: Callable[[], T]) -> tuple[T, list[LeaseOut], set[str]]:
    """Grants racing `change`: what it returned, the leases granted, and those that
    committed after `change` did."""
    before = lease_ids(ledger)
    with granting(ledger) as granted:
        wait_for_grants(granted, at_least=3)
        changed = change()
        seen_after_change = lease_ids(ledger)
    late = lease_ids(ledger) - seen_after_change
    assert {x.id for x in granted} == lease_ids(ledger) - before
    return changed, list(granted), late


def drain(ledger: Ledger) -> None:
    draining.drain_device(
        ledger, "dev-0", "admin", deadline_s=3600, now_=False, revoke_deadline_s=30
    )


def cut_quota(ledger: Ledger) -> int:
    """Cut the tenant's quota to what it holds now; the quota it was cut to.

    What it holds only grows, so once the cut has committed there is no room for
    one more lease.
    """
    held = tenants.get_tenant(ledger, "t1").leased_bytes
    tenants.update_tenant(ledger, "t1", TenantUpdate(quota_bytes=held), "admin")
    return held


def test_a_drain_fences_out_racing_grants(ledger: Ledger) -> None:
    skip_sqlite(ledger)
    seeded(ledger)
    for iteration in range(ITERATIONS):
        if iteration:
            draining.undrain_device(ledger, "dev-0", "admin")
        gen_before = generation(ledger, Device)
        _, granted, late = race(ledger, lambda: drain(ledger))
        gen_after = generation(ledger, Device)
        epochs = sorted(x.epoch for x in granted)
        where = f"iteration {iteration}: generation {gen_before} -> {gen_after}, epochs {epochs}"
        assert gen_after == gen_before + len(granted) + 1, f"a bump was lost; {where}"
        assert all(epoch < gen_after for epoch in epochs), (
            f"a grant swapped after the drain; {where}"
        )
        assert late == set(), f"{len(late)} lease(s) granted after the drain committed; {where}"


def test_a_quota_cut_fences_out_racing_grants(ledger: Ledger) -> None:
    skip_sqlite(ledger)
    seeded(ledger)
    for iteration in range(ITERATIONS):
        if iteration:
            tenants.update_tenant(
                ledger, "t1", TenantUpdate(quota_bytes=ROOMY_QUOTA_BYTES), "admin"
            )
        gen_before = generation(ledger, Tenant)
        quota, granted, late = race(ledger, lambda: cut_quota(ledger))
        gen_after = generation(ledger, Tenant)
        live = tenants.get_tenant(ledger, "t1").leased_bytes
        where = (
            f"iteration {iteration}: generation {gen_before} -> {gen_after}, "
            f"{len(granted)} granted, quota cut to {quota}, {live} bytes live"
        )
        assert gen_after == gen_before + len(granted) + 1, f"a bump was lost; {where}"
        assert late == set(), f"{len(late)} lease(s) granted after the cut committed; {where}"


def test_a_host_drain_fences_out_racing_grants(ledger: Ledger) -> None:
    skip_sqlite(ledger)
    seeded(ledger)
    for iteration in range(ITERATIONS):
        if iteration:
            draining.drain_host(ledger, "h1", "admin", draining=False)
        gen_before = generation(ledger, Host)
        _, granted, late = race(ledger, lambda: draining.drain_host(ledger, "h1", "admin"))
        gen_after = generation(ledger, Host)
        where = f"iteration {iteration}: host generation {gen_before} -> {gen_after}"
        assert gen_after == gen_before + len(granted) + 1, f"a bump was lost; {where}"
        assert late == set(), f"{len(late)} lease(s) granted after the drain committed; {where}"
