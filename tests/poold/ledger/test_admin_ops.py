"""An administrator's `end_lease`, `delete_host` and idempotent drains, on SQLite and PostgreSQL.

Ending a lease never frees bytes an agent may still map: an orphaned lease is reclaimed
at once, a held one is revoked due now and learned in the next heartbeat reply. Deleting
a host kills its credential in the same commit and takes its devices out of placement.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from poold.errors import (
    HostBusy,
    InvalidTransition,
    LeaseNotActive,
    QuotaExceeded,
    Unauthorized,
    UnknownHost,
    UnknownLease,
)
from poold.ledger import (
    admin_ops,
    capacity,
    draining,
    heartbeat,
    host_deletion,
    hosts,
    lease_views,
    leases,
    op_batches,
)
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DevicePath, Event, Host, Quarantine
from poold.ledger.types import utcnow
from poold.wire.agent import GrantRequest, Heartbeat, LeaseOp
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, device, seed

# A multi-headed CXL device's uid (memdev serials): the same memory from every head.
SHARED = "cxl:ram:serials=3,4:ways=2:gran=4096:size=67108864"


def grant(ledger: Ledger, host: str = "h1", *, activate: bool = True, mib: int = 4) -> LeaseOut:
    return leases.grant(
        ledger,
        host,
        GrantRequest(
            tenant="t1", size_bytes=mib * MiB, uid=UID, pid=42, ttl_s=3600, activate=activate
        ),
        "agent:test",
    )


def op(ledger: Ledger, lease_id: str, name: str, host: str = "h1") -> None:
    [result] = op_batches.apply_ops(
        ledger, host, [LeaseOp(lease_id=lease_id, op=name)], "agent:test"
    )  # type: ignore[arg-type]
    assert result.code is None, result


def reach(ledger: Ledger, host: str, uid: str) -> None:
    """A second host's path to a device (as its agent's inventory would make it)."""
    with ledger.write() as s:
        dev = s.scalars(select(Device).where(Device.uid == uid)).one()
        row, _credential = hosts.add(s, host, "test")
        s.add(DevicePath(device_id=dev.id, host_id=row.id, local_name="node9", seen_at=utcnow()))


def events(ledger: Ledger, **where: object) -> list[Event]:
    with ledger.read() as s:
        stmt = select(Event).order_by(Event.id)
        for key, value in where.items():
            stmt = stmt.where(getattr(Event, key) == value)
        rows = list(s.scalars(stmt))
        for row in rows:
            s.expunge(row)
    return rows


# --- leases end ---------------------------------------------------------------------------


def test_an_orphaned_lease_ends_at_once_and_stops_counting(ledger: Ledger) -> None:
    seed(ledger, quota_leases=1)
    lease = grant(ledger)
    op(ledger, lease.id, "orphan")
    with pytest.raises(QuotaExceeded):
        grant(ledger)  # the orphan still counts against --max-leases
    out = admin_ops.end_lease(ledger, lease.id, "admin", "holder gone for good")
    assert (out.action, out.changed, out.lease.state) == ("reclaimed", True, "reclaimed")
    [last] = events(ledger, lease_id=lease.id)[-1:]
    assert (last.kind, last.actor, last.from_state, last.to_state, last.reason) == (
        "lease.reclaim",
        "admin",
        "orphaned",
        "reclaimed",
        "holder gone for good",
    )
    assert grant(ledger).state == "active"  # the tenant may lease again


def test_a_held_lease_is_revoked_due_now_and_its_agent_learns_it(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    before = utcnow()
    out = admin_ops.end_lease(ledger, lease.id, "admin", "maintenance")
    assert (out.action, out.changed, out.lease.state) == ("revoked", True, "revoking")
    assert before <= out.lease.expires_at <= utcnow()
    # Its bytes stay taken until the agent confirms: a new lease is placed elsewhere.
    other = grant(ledger)
    assert other.offset_bytes >= lease.offset_bytes + lease.length_bytes
    with ledger.write() as s:
        reply = heartbeat.heartbeat(s, hosts.get_by_name(s, "h1"), Heartbeat())
    [revocation] = [r for r in reply.revocations if r.lease_id == lease.id]
    assert revocation.deadline_at is not None and revocation.deadline_at <= utcnow()
    [confirmed] = admin_ops.confirm_revoked(ledger, "h1", [lease.id], "agent:h1")
    assert confirmed.state == "reclaimed"


def test_a_revoking_lease_has_its_deadline_pulled_in(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    far = admin_ops.revoke_lease(ledger, lease.id, "later", "admin", deadline_s=3600)
    assert far.expires_at > utcnow() + timedelta(seconds=3000)
    out = admin_ops.end_lease(ledger, lease.id, "admin", "now please")
    assert (out.action, out.changed, out.lease.state) == ("revoked", True, "revoking")
    assert out.lease.expires_at <= utcnow()
    assert events(ledger, lease_id=lease.id)[-1].kind == "lease.end"
    again = admin_ops.end_lease(ledger, lease.id, "admin", "again")
    assert (again.action, again.changed) == ("revoked", False)  # due already: nothing written
    assert events(ledger, lease_id=lease.id)[-1].reason == "now please"


def test_granted_is_aborted_ended_is_unchanged_unknown_is_refused(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger, activate=False)
    out = admin_ops.end_lease(ledger, lease.id, "admin", "stale")
    assert (out.action, out.lease.state) == ("aborted", "aborted")
    count = len(events(ledger, lease_id=lease.id))
    again = admin_ops.end_lease(ledger, lease.id, "admin", "stale")
    assert (again.action, again.changed, again.lease.state) == ("none", False, "aborted")
    assert len(events(ledger, lease_id=lease.id)) == count
    with pytest.raises(UnknownLease):
        admin_ops.end_lease(ledger, "no-such-lease", "admin", "x")


def test_a_scrubbing_lease_is_refused(ledger: Ledger) -> None:
    seed(ledger, devices=[device("dax-0", kind="devdax", local_name="dax0")])
    lease = grant(ledger)
    op(ledger, lease.id, "release_dirty")
    with pytest.raises(InvalidTransition) as err:
        admin_ops.end_lease(ledger, lease.id, "admin", "x")
    assert "zeroed" in err.value.message
    assert lease_views.show(ledger, lease.id).state == "scrubbing"


def test_revoke_of_an_ended_lease_is_lease_not_active_in_plain_words(ledger: Ledger) -> None:
    """As a release of one is; a live lease revoke does not apply to says what does."""
    seed(ledger, devices=[device("dax-0", kind="devdax", local_name="dax0")])
    released = grant(ledger)
    op(ledger, released.id, "release")
    granted = grant(ledger, activate=False)
    aborted = grant(ledger, activate=False)
    admin_ops.end_lease(ledger, aborted.id, "admin", "stale")
    scrubbing = grant(ledger)
    op(ledger, scrubbing.id, "release_dirty")
    revoking = grant(ledger)
    admin_ops.revoke_lease(ledger, revoking.id, "x", "admin", deadline_s=60)
    for lease_id in (released.id, aborted.id):
        with pytest.raises(LeaseNotActive) as ended:
            admin_ops.revoke_lease(ledger, lease_id, "x", "admin", deadline_s=60)
        assert "has ended" in ended.value.message and "transition" not in ended.value.message
        assert ended.value.detail["lease_id"] == lease_id
    for lease_id, words in (
        (granted.id, "leases end` aborts it"),
        (revoking.id, "revoked already"),
        (scrubbing.id, "zeroed"),
    ):
        with pytest.raises(InvalidTransition) as live:
            admin_ops.revoke_lease(ledger, lease_id, "x", "admin", deadline_s=60)
        assert words in live.value.message and "no transition" not in live.value.message


# --- idempotent drain and undrain ----------------------------------------------------------


def test_undrain_twice_and_drain_twice_say_whether_anything_changed(ledger: Ledger) -> None:
    seed(ledger)
    first = draining.drain_host(ledger, "h1", "admin")
    second = draining.drain_host(ledger, "h1", "admin")
    assert (first.changed, second.changed) == (True, False)
    assert second.state == "draining"
    back = draining.drain_host(ledger, "h1", "admin", draining=False)
    again = draining.drain_host(ledger, "h1", "admin", draining=False)
    assert (back.changed, again.changed, again.state) == (True, False, "up")
    assert [e.kind for e in events(ledger) if e.kind.startswith("host.")] == [
        "host.add",
        "host.drain",
        "host.undrain",
    ]
    dev = draining.drain_device(
        ledger, "dev-0", "admin", deadline_s=60, now_=False, revoke_deadline_s=30
    )
    assert dev.changed
    assert draining.undrain_device(ledger, "dev-0", "admin").changed
    out = draining.undrain_device(ledger, "dev-0", "admin")
    assert (out.changed, out.state) == (False, "online")


# --- hosts delete -----------------------------------------------------------------------------


def test_a_host_with_live_leases_is_refused_unless_forced(ledger: Ledger) -> None:
    credential = seed(ledger)
    kept = grant(ledger)
    orphan = grant(ledger)
    op(ledger, orphan.id, "orphan")
    pending = grant(ledger, activate=False)
    with pytest.raises(HostBusy) as err:
        host_deletion.delete_host(ledger, "h1", "admin")
    assert err.value.detail["live_leases"] == 3 and "3 live lease(s)" in err.value.message
    assert hosts.authenticate(ledger, hosts.hash_credential(credential)) == "h1"

    out = host_deletion.delete_host(ledger, "h1", "admin", force=True)
    assert sorted(out.ended_leases) == sorted([kept.id, orphan.id, pending.id])
    assert out.history_kept and out.devices_missing == ["dev-0"] and out.devices_removed == []
    states = {x: lease_views.show(ledger, x).state for x in out.ended_leases}
    assert states == {kept.id: "reclaimed", orphan.id: "reclaimed", pending.id: "aborted"}
    # One event per move, the administrator's, naming the host.
    moves = [(e.kind, e.actor) for e in events(ledger, lease_id=kept.id)][-2:]
    assert moves == [("lease.revoke", "admin"), ("lease.reclaim", "admin")]
    # The credential is dead at once, like an unknown one.
    with pytest.raises(Unauthorized):
        hosts.authenticate(ledger, hosts.hash_credential(credential))
    assert hosts.list_hosts(ledger) == []
    with pytest.raises(UnknownHost):
        host_deletion.delete_host(ledger, "h1", "admin")
    with ledger.read() as s:
        assert s.scalar(select(Device.state).where(Device.uid == "dev-0")) == "missing"
    assert [e.kind for e in events(ledger) if e.kind.startswith(("host.", "device."))][-2:] == [
        "device.missing",
        "host.delete",
    ]

    # The name is free again: a new host, a new credential.
    added = hosts.add_host(ledger, "h1", "admin")
    assert [h.name for h in hosts.list_hosts(ledger)] == ["h1"]
    assert hosts.authenticate(ledger, hosts.hash_credential(added.credential)) == "h1"


def test_a_host_without_history_goes_whole_and_shared_devices_stay(ledger: Ledger) -> None:
    seed(ledger, devices=[device("dev-own"), device(SHARED, local_name="node3")])
    reach(ledger, "h2", SHARED)
    out = host_deletion.delete_host(ledger, "h1", "admin")
    assert (out.history_kept, out.devices_removed, out.devices_missing) == (
        False,
        ["dev-own"],
        [],
    )
    with ledger.read() as s:
        assert s.scalar(select(Host.id).where(Host.name.like("h1%"))) is None
        assert s.scalar(select(Device.id).where(Device.uid == "dev-own")) is None
    [shared] = capacity.pool_status(ledger).devices
    assert (shared.uid, shared.state, shared.hosts) == (SHARED, "online", ["h2"])


def test_a_forced_delete_quarantines_devdax_ranges_nobody_zeroed(ledger: Ledger) -> None:
    dax = device(SHARED, kind="devdax", local_name="dax0")
    seed(ledger, devices=[dax])
    reach(ledger, "h2", SHARED)
    held = grant(ledger, mib=8)
    scrubbing = grant(ledger, mib=4)
    op(ledger, scrubbing.id, "release_dirty")
    out = host_deletion.delete_host(ledger, "h1", "admin", force=True)
    assert sorted(out.quarantined_leases) == sorted([held.id, scrubbing.id])
    assert {lease_views.show(ledger, x).state for x in out.ended_leases} == {"reclaimed"}
    with ledger.read() as s:
        ranges = sorted(s.execute(select(Quarantine.offset_bytes, Quarantine.length_bytes)).all())
    expected = sorted(
        [(held.offset_bytes, held.length_bytes), (scrubbing.offset_bytes, scrubbing.length_bytes)]
    )
    assert [tuple(r) for r in ranges] == expected
    [status] = capacity.pool_status(ledger).devices
    assert sorted(status.quarantined_extents) == expected
    assert status.quarantined_bytes == 12 * MiB and status.hosts == ["h2"]
    assert status.free_bytes == status.capacity_bytes - 12 * MiB


def test_a_still_mapped_lease_is_not_ended_but_goes_with_its_host(ledger: Ledger) -> None:
    seed(ledger)
    lease = grant(ledger)
    op(ledger, lease.id, "release_mapped")  # released, but its holder still maps the memfd
    with pytest.raises(InvalidTransition) as err:
        admin_ops.end_lease(ledger, lease.id, "admin", "x")
    assert "still maps" in err.value.message
    out = host_deletion.delete_host(ledger, "h1", "admin", force=True)
    assert out.ended_leases == [lease.id]
    assert lease_views.show(ledger, lease.id).state == "released"  # its pages left with the host
