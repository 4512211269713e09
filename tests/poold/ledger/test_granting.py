"""What a grant reads of the devices a host reaches, on SQLite and PostgreSQL: what
occupies them is what placement needs (`extents.normalise_used`'s runs of it), and on
PostgreSQL the database hands back those runs themselves, not every extent."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from poold.extents import Extent, normalise_used
from poold.ledger import granting, hosts, tenants
from poold.ledger.budgets import QuotaUse
from poold.ledger.db import Ledger
from poold.ledger.models import Quarantine
from tests.poold.conftest import UID, MiB, device, seed
from tests.poold.ledger.test_leases import grant, release

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
    granted = [grant(ledger, 2 * MiB) for _ in range(5)]
    release(ledger, granted[1].id)
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


# Rows no grant writes but a quarantine table without checks can hold: a device's first
# extent starting below zero, empty and negative extents at the offset where a run
# starts, repeats. Each case failed a cheaper formulation of the runs statement tried
# and not kept (one window pass and a LEAD over the starts: a start sentinel of -1; two
# starts at one offset).
EDGES = (
    [(-1, 5), (35, 1), (35, 1), (36, -2), (36, 0), (36, 3), (46, 3), (52, 2)],
    [(38, -2), (38, 0), (38, 10), (38, 10), (68, 2), (70, -2), (74, 0), (74, 3)],
    [(0, 0), (0, 4), (4, 0), (4, 4), (9, -9), (9, 1), (60, 10)],
)


@pytest.mark.parametrize("rows", EDGES)
def test_odd_extents_read_as_normalise_used_makes_them(
    ledger: Ledger, rows: list[tuple[int, int]]
) -> None:
    seed(ledger, devices=[device("dev-0")])
    host_id = hosts.host_id_of(ledger, "h1")
    with ledger.write_conn() as conn:
        (dev,) = granting.host_devices(conn, host_id)
    extents = [Extent(offset * MiB, length * MiB) for offset, length in rows]
    quarantine(ledger, [(dev.id, ext) for ext in extents])
    _, with_use, alone = read(ledger)
    for got in (with_use, alone):
        assert normalise_used(CAPACITY, got[dev.id]) == normalise_used(CAPACITY, extents)
        if ledger.engine.dialect.name == "postgresql":
            # The runs themselves, below zero clipped as normalise_used clips it.
            runs = sorted((max(e.offset, 0), e.end) for e in got[dev.id] if e.length > 0)
            assert runs == [(e.offset, e.end) for e in normalise_used(UNCLIPPED, extents)]
        else:  # every extent, odd ones too, exactly as stored: nothing merged or lost
            assert sorted(got[dev.id]) == sorted(extents)
