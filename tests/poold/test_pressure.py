"""poold/pressure.py: who is asked to give memory back, and how much (replica-first)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poold.pressure import DeviceFree, LeaseUse, ShrinkRequest, plan, shortfall, watermark_bytes

NOW = datetime(2026, 1, 1, tzinfo=UTC)
MIB = 1 << 20


def use(
    lease_id: str,
    tenant: int,
    *,
    length: int = 16 * MIB,
    exclusive: int = 0,
    replica: int = 0,
    device: int = 1,
    reported: bool = True,
) -> LeaseUse:
    return LeaseUse(
        lease_id=lease_id,
        tenant_id=tenant,
        device_id=device,
        length_bytes=length,
        reported=reported,
        used_bytes=exclusive + replica,
        exclusive_bytes=exclusive,
        replica_bytes=replica,
    )


def asked(requests: list[ShrinkRequest]) -> dict[str, tuple[int, int]]:
    return {r.lease_id: (r.target_bytes, r.replica_bytes) for r in requests}


DEV = DeviceFree(device_id=1, capacity_bytes=100 * MIB, free_bytes=0)


@pytest.mark.parametrize(
    ("free", "leases", "expected"),
    [
        # Above the watermark (5 MiB): nobody is asked.
        (5 * MIB, [use("a", 1, replica=16 * MIB)], {}),
        # Unused leased bytes are asked first (shrinking loses nothing): 6 MiB unused.
        (0, [use("a", 1, exclusive=10 * MIB)], {"a": (5 * MIB, 0)}),
        # The biggest slack first, before any replica.
        (
            0,
            [use("s", 1, exclusive=4 * MIB), use("r", 2, replica=16 * MIB)],
            {"s": (5 * MIB, 0)},
        ),
        # Slack, then replicas: 2 MiB unused + 3 MiB of replicas.
        (
            0,
            [use("m", 1, exclusive=4 * MIB, replica=10 * MIB)],
            {"m": (5 * MIB, 3 * MIB)},
        ),
        # 1 MiB short: the replica holder, not the bigger exclusive-only lease.
        (
            4 * MIB,
            [use("x", 2, exclusive=16 * MIB), use("r", 1, exclusive=8 * MIB, replica=8 * MIB)],
            {"r": (MIB, MIB)},
        ),
        # The tenant with most replica bytes first, even when its leases are smaller.
        (
            0,
            [
                use("t1a", 1, replica=3 * MIB, exclusive=13 * MIB),
                use("t1b", 1, replica=3 * MIB, exclusive=13 * MIB),
                use("t2", 2, replica=4 * MIB, exclusive=12 * MIB),
            ],
            {"t1a": (3 * MIB, 3 * MIB), "t1b": (2 * MIB, 2 * MIB)},
        ),
        # Replicas are not enough: all of them, then exclusive bytes, biggest first.
        (
            0,
            [
                use("r", 1, replica=2 * MIB, exclusive=14 * MIB),
                use("x", 2, exclusive=16 * MIB),
            ],
            {"r": (2 * MIB, 2 * MIB), "x": (3 * MIB, 0)},
        ),
        # Never-reported leases are not asked (and their unused bytes are not counted).
        (0, [use("u", 1, replica=16 * MIB, reported=False)], {}),
        # Leases on other devices are not this device's business.
        (0, [use("o", 1, replica=16 * MIB, device=2)], {}),
    ],
)
def test_plan_table(
    free: int, leases: list[LeaseUse], expected: dict[str, tuple[int, int]]
) -> None:
    dev = DeviceFree(1, 100 * MIB, free)
    got = plan([dev], leases, watermark=0.05, now=NOW, deadline_s=30)
    assert asked(got) == expected
    assert all(r.deadline_at == NOW + timedelta(seconds=30) for r in got)


def test_watermark_zero_is_off_and_bad_watermarks_are_refused() -> None:
    leases = [use("a", 1, replica=16 * MIB)]
    assert plan([DEV], leases, watermark=0, now=NOW) == []
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="watermark"):
            plan([DEV], leases, watermark=bad, now=NOW)


def test_each_device_is_planned_on_its_own() -> None:
    devs = [DeviceFree(1, 100 * MIB, 0), DeviceFree(2, 100 * MIB, 50 * MIB)]
    leases = [use("a", 1, replica=16 * MIB, device=1), use("b", 2, replica=16 * MIB, device=2)]
    assert asked(plan(devs, leases, watermark=0.05, now=NOW)) == {"a": (5 * MIB, 5 * MIB)}


LEASES = st.lists(
    st.tuples(
        st.integers(1, 4),  # tenant
        st.integers(0, 8),  # exclusive MiB
        st.integers(0, 8),  # replica MiB
        st.integers(0, 4),  # unused MiB
        st.booleans(),  # reported
    ),
    max_size=12,
)


@given(LEASES, st.integers(0, 40), st.sampled_from([0.01, 0.05, 0.2, 0.5]))
def test_replica_first_invariants(
    rows: list[tuple[int, int, int, int, bool]], free_mib: int, watermark: float
) -> None:
    leases = [
        LeaseUse(
            lease_id=f"l{i}",
            tenant_id=tenant,
            device_id=1,
            length_bytes=(exclusive + replica + unused) * MIB or MIB,
            reported=reported,
            used_bytes=(exclusive + replica) * MIB,
            exclusive_bytes=exclusive * MIB,
            replica_bytes=replica * MIB,
        )
        for i, (tenant, exclusive, replica, unused, reported) in enumerate(rows)
    ]
    capacity = sum(x.length_bytes for x in leases) + free_mib * MIB or MIB
    dev = DeviceFree(1, capacity, free_mib * MIB)
    got = plan([dev], leases, watermark=watermark, now=NOW)
    by_id = {x.lease_id: x for x in leases}
    need = shortfall(dev, watermark)
    reported = [x for x in leases if x.reported]
    total_unused = sum(x.length_bytes - x.used_bytes for x in reported)
    total_replica = sum(x.replica_bytes for x in reported)
    total = sum(x.length_bytes for x in reported)

    assert len({r.lease_id for r in got}) == len(got)
    assert all(r.target_bytes > 0 for r in got)
    for r in got:
        lease = by_id[r.lease_id]
        assert lease.reported
        assert 0 <= r.replica_bytes <= lease.replica_bytes
        assert r.target_bytes <= lease.length_bytes
    # As much as is needed, no more (or everything there is).
    assert sum(r.target_bytes for r in got) == min(need, total)
    asked_replica = sum(r.replica_bytes for r in got)
    asked_other = sum(r.target_bytes - r.replica_bytes for r in got)
    # Slack first, then replicas, then exclusive bytes.
    assert asked_replica == min(max(0, need - total_unused), total_replica)
    if asked_replica:
        assert asked_other >= total_unused
    # No exclusive byte is asked for while a replica byte is not.
    if asked_other > total_unused:
        assert asked_replica == total_replica
    # Tenants with more replica bytes are asked before tenants with fewer.
    per_tenant: dict[int, int] = {}
    for x in reported:
        per_tenant[x.tenant_id] = per_tenant.get(x.tenant_id, 0) + x.replica_bytes
    asked_tenants = {by_id[r.lease_id].tenant_id for r in got if r.replica_bytes}
    for t in asked_tenants:
        for other, replica in per_tenant.items():
            if replica > per_tenant[t]:
                other_asked = sum(
                    r.replica_bytes for r in got if by_id[r.lease_id].tenant_id == other
                )
                assert other_asked == replica, "a richer tenant was not fully asked first"
    if need == 0:
        assert got == []
    assert need == max(0, watermark_bytes(capacity, watermark) - dev.free_bytes)


def test_a_waiting_lease_request_is_pressure_even_above_the_watermark() -> None:
    """Admission: room for a waiting request is asked back, replicas first."""
    leases = [
        use("rep", 1, length=32 * MIB, exclusive=8 * MIB, replica=24 * MIB),
        use("exc", 2, length=32 * MIB, exclusive=32 * MIB),
    ]
    full = DeviceFree(device_id=1, capacity_bytes=64 * MIB, free_bytes=0)
    assert plan([full], leases, watermark=0, now=NOW) == []  # pressure off, nobody waits
    waiting = DeviceFree(device_id=1, capacity_bytes=64 * MIB, free_bytes=0, wanted_bytes=16 * MIB)
    assert shortfall(waiting, 0) == 16 * MIB
    assert asked(plan([waiting], leases, watermark=0, now=NOW)) == {"rep": (16 * MIB, 16 * MIB)}
