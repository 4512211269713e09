"""What a grant reads of the devices a host reaches, on SQLite and PostgreSQL: what
occupies them is what placement needs (`extents.normalise_used`'s runs of it), and on
PostgreSQL the database hands back those runs themselves, not every extent."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from poold.extents import Extent, normalise_used
from poold.ledger import granting, hosts, leases, tenants
from poold.ledger.db import Ledger
from poold.ledger.models import Quarantine
from poold.wire.agent import GrantRequest
from tests.poold.conftest import UID, MiB, device, seed

CAPACITY = 64 * MiB


def runs(ledger: Ledger) -> tuple[dict[int, list[Extent]], dict[int, list[Extent]]]:
    """What occupies h1's devices as a central grant reads it (with t1's quota use),
    and as placing a reservation does (`candidates` alone)."""
    host_id = hosts.host_id_of(ledger, "h1")
    with ledger.write_conn() as conn:
        tenant = tenants.resolve(conn, "t1", UID, [], "h1")
        _, with_use = granting.use_and_occupancy(conn, tenant.id, host_id)
        found, _ = granting.candidates(conn, host_id)
    alone = {c.device_id: [e for e in c.used if e not in c.reserved] for c in found}
    return dict(with_use), {d: used for d, used in alone.items() if used}


def test_occupied_extents_come_back_as_their_runs(ledger: Ledger) -> None:
    seed(ledger, devices=[device("dev-0"), device("dev-1")], quota_leases=1000)
    # Leases packed by best fit (one run), then quarantined ranges at random: overlapping,
    # touching, nested, repeated, over leases and over each other.
    for _ in range(5):
        leases.grant(
            ledger,
            "h1",
            GrantRequest(tenant="t1", size_bytes=2 * MiB, uid=UID, pid=1, activate=True),
            "agent:test",
        )
    rng = random.Random(12)  # noqa: S311 - reproducible extents, not a secret
    host_id = hosts.host_id_of(ledger, "h1")
    with ledger.write_conn() as conn:
        occupied: dict[int, list[Extent]] = {
            dev.id: [] for dev in granting.host_devices(conn, host_id)
        }
        for device_id, offset, length in conn.exec_driver_sql(
            "SELECT device_id, offset_bytes, length_bytes FROM leases"
        ):
            occupied[device_id].append(Extent(offset, length))
    for round_ in range(12):
        with ledger.write() as s:
            for device_id, extents in occupied.items():
                for _ in range(rng.randrange(0, 6)):
                    offset = rng.randrange(0, 60) * MiB
                    length = rng.choice([1, 2, 3, 7]) * MiB
                    if extents and rng.random() < 0.3:  # touch or repeat one
                        prev = rng.choice(extents)
                        offset = rng.choice([prev.end, prev.offset])
                    extents.append(Extent(offset, length))
                    s.add(
                        Quarantine(
                            device_id=device_id,
                            offset_bytes=offset,
                            length_bytes=length,
                            reason=f"round {round_}",
                            created_at=datetime.now(UTC),
                        )
                    )
        expected = {
            d: normalise_used(CAPACITY, extents) for d, extents in occupied.items() if extents
        }
        with_use, alone = runs(ledger)
        for read in (with_use, alone):
            assert {d: normalise_used(CAPACITY, e) for d, e in read.items()} == expected
            if ledger.engine.dialect.name == "postgresql":  # the runs, read as they are
                assert {d: sorted(e) for d, e in read.items()} == expected
