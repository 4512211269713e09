"""What a grant reads of the devices a host reaches, on SQLite and PostgreSQL: what
occupies them is what placement needs (`extents.normalise_used`'s runs of it), and on
PostgreSQL the database hands back those runs themselves, not every extent."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from poold.extents import Extent, normalise_used
from poold.ledger import granting, hosts, leases, op_batches, tenants
from poold.ledger.budgets import QuotaUse
from poold.ledger.db import Ledger
from poold.ledger.models import Quarantine
from poold.wire.agent import GrantRequest, LeaseOp
from tests.poold.conftest import UID, MiB, device, seed

CAPACITY = 64 * MiB
UNCLIPPED = 1 << 62  # merged, not clipped to the device: what the database hands back
SEEDS = (2, 3, 12)


def read(ledger: Ledger) -> tuple[QuotaUse, dict[int, list[Extent]], dict[int, list[Extent]]]:
    """t1's quota use and what occupies h1's devices as a central grant reads them, and
    what occupies them as placing a reservation reads it (`candidates` alone)."""
    host_id = hosts.host_id_of(ledger, "h1")
    with ledger.write_conn() as conn:
        tenant = tenants.resolve(conn, "t1", UID, [], "h1")
        use, with_use = granting.use_and_occupancy(conn, tenant.id, host_id)
        found, _ = granting.candidates(conn, host_id)
    alone = {c.device_id: list(c.used) for c in found if c.used}
    return use, dict(with_use), alone


def quarantine(ledger: Ledger, rows: list[tuple[int, Extent]]) -> None:
    with ledger.write() as s:
        for device_id, ext in rows:
            s.add(
                Quarantine(
                    device_id=device_id,
                    offset_bytes=ext.offset,
                    length_bytes=ext.length,
                    reason="test",
                    created_at=datetime.now(UTC),
                )
            )


@pytest.mark.parametrize("rng_seed", SEEDS)
def test_occupied_extents_come_back_as_their_runs(ledger: Ledger, rng_seed: int) -> None:
    seed(ledger, devices=[device("dev-0"), device("dev-1")], quota_leases=1000)
    # Leases packed by best fit, one of them released (an ended lease occupies nothing),
    # then quarantined ranges at random: overlapping, touching, nested, repeated, empty,
    # past the device's end, over leases and over each other.
    granted = [
        leases.grant(
            ledger,
            "h1",
            GrantRequest(tenant="t1", size_bytes=2 * MiB, uid=UID, pid=1, activate=True),
            "agent:test",
        )
        for _ in range(5)
    ]
    ended = granted[1]
    op_batches.apply_ops(ledger, "h1", [LeaseOp(lease_id=ended.id, op="release")], "agent:h1")
    host_id = hosts.host_id_of(ledger, "h1")
    with ledger.write_conn() as conn:
        occupied: dict[int, list[Extent]] = {
            dev.id: [] for dev in granting.host_devices(conn, host_id)
        }
    with ledger.write_conn() as conn:
        for device_id, offset, length in conn.exec_driver_sql(
            "SELECT device_id, offset_bytes, length_bytes FROM leases WHERE ended_at IS NULL"
        ):
            occupied[device_id].append(Extent(offset, length))
    assert sum(map(len, occupied.values())) == 4

    rng = random.Random(rng_seed)  # noqa: S311 - reproducible extents, not a secret
    for _ in range(12):
        new: list[tuple[int, Extent]] = []
        for device_id, extents in occupied.items():
            for _ in range(rng.randrange(0, 6)):
                ext = Extent(rng.randrange(0, 62) * MiB, rng.choice([0, 1, 2, 3, 7]) * MiB)
                if extents and rng.random() < 0.4:  # touch, repeat or start with one
                    prev = rng.choice(extents)
                    ext = rng.choice(
                        [prev, Extent(prev.end, ext.length), Extent(prev.offset, ext.length)]
                    )
                extents.append(ext)
                new.append((device_id, ext))
        quarantine(ledger, new)
        expected = {d: normalise_used(CAPACITY, e) for d, e in occupied.items()}
        expected = {d: e for d, e in expected.items() if e}
        use, with_use, alone = read(ledger)
        assert (use.leases(), use.bytes()) == (4, 8 * MiB)
        for got in (with_use, alone):
            # What placement makes of it: the same on both backends.
            assert {d: normalise_used(CAPACITY, e) for d, e in got.items()} == expected
            if ledger.engine.dialect.name == "postgresql":
                # The runs themselves, as the database merged them (not clipped: the
                # consumers clip), empty ones aside.
                runs = {d: sorted(e for e in got[d] if e.length > 0) for d in got}
                merged = {d: normalise_used(UNCLIPPED, e) for d, e in occupied.items()}
                assert {d: r for d, r in runs.items() if r} == {
                    d: m for d, m in merged.items() if m
                }
