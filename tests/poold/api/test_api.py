"""poold's HTTP API over real loopback HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from poold.api.client import PooldClient
from poold.errors import AlreadyExists, Forbidden, TenantInUse, Unauthorized, UnknownTenant
from poold.ledger.db import Ledger
from poold.wire.admin import TenantSpec, TenantUpdate
from poold.wire.agent import GrantRequest, Heartbeat, LeaseOp, Renewal
from tests.conftest import ThreadedServer
from tests.poold.api.conftest import EMULATED, Agent, Raw
from tests.poold.conftest import GID, UID, GiB, MiB, snapshot

GRANT = GrantRequest(tenant="t1", size_bytes=3 * MiB, uid=UID, gids=[GID], pid=4242)


def test_health(admin: PooldClient) -> None:
    assert admin.health()["status"] == "ok"


# --- tenants -----------------------------------------------------------------


def test_tenant_create_read_update_delete(admin: PooldClient) -> None:
    created = admin.create_tenant(
        TenantSpec(
            name="kv-a",
            quota_bytes=4 * GiB,
            quota_leases=16,
            allowed_media=["ddr5", "emulated"],
            allowed_uids=[1001, 1000, 1000],
            allowed_gids=[50],
            allowed_hosts=["h1"],
        )
    )
    assert (created.name, created.quota_bytes, created.quota_leases) == ("kv-a", 4 * GiB, 16)
    assert created.allowed_uids == [1000, 1001]
    assert created.allowed_gids == [50]
    assert created.allowed_media == ["ddr5", "emulated"]
    assert (created.leased_bytes, created.live_leases) == (0, 0)
    assert admin.get_tenant("kv-a") == created
    assert [t.name for t in admin.list_tenants()] == ["kv-a"]

    updated = admin.update_tenant(
        "kv-a", TenantUpdate(quota_bytes=8 * GiB, quota_leases=2, allowed_uids=[7])
    )
    assert (updated.quota_bytes, updated.quota_leases, updated.allowed_uids) == (8 * GiB, 2, [7])
    assert updated.allowed_gids == [50], "fields left out are not touched"
    assert admin.get_tenant("kv-a") == updated

    with pytest.raises(AlreadyExists):
        admin.create_tenant(TenantSpec(name="kv-a", quota_bytes=0))
    admin.delete_tenant("kv-a")
    with pytest.raises(UnknownTenant):
        admin.get_tenant("kv-a")
    assert admin.list_tenants() == []


def test_tenant_with_live_lease_cannot_be_deleted(admin: PooldClient, agent: Agent) -> None:
    lease = agent.client.grant(GRANT)
    with pytest.raises(TenantInUse):
        admin.delete_tenant("t1")
    t = admin.get_tenant("t1")
    assert (t.leased_bytes, t.live_leases) == (4 * MiB, 1)
    agent.client.release(lease.id)
    admin.delete_tenant("t1")
    # Its ended leases keep their history, under the tenant's tombstone.
    assert admin.show_lease(lease.id).tenant.startswith("t1~deleted~")
    with pytest.raises(UnknownTenant):
        admin.get_tenant("t1")
    # The name is free again.
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=0))


def test_tenant_with_longest_name_can_be_deleted_after_use(
    admin: PooldClient, agent: Agent
) -> None:
    name = "t" * 128
    admin.create_tenant(TenantSpec(name=name, quota_bytes=GiB, allowed_uids=[99]))
    lease = agent.client.grant(GRANT.model_copy(update={"tenant": name, "uid": 99}))
    agent.client.release(lease.id)
    admin.delete_tenant(name)
    with pytest.raises(UnknownTenant):
        admin.get_tenant(name)


# --- hosts and registration ----------------------------------------------------


def test_host_add_returns_credential_once(admin: PooldClient, ledger: Ledger) -> None:
    created = admin.add_host("h9")
    assert created.name == "h9" and created.status == "down"
    assert created.credential.startswith("pa1.h9.")
    listed = admin.list_hosts()
    assert [h.name for h in listed] == ["h9"]
    assert "credential" not in listed[0].model_dump()
    # Only a hash is stored.
    dump = repr(snapshot(ledger))
    assert created.credential not in dump
    with pytest.raises(AlreadyExists):
        admin.add_host("h9")


def test_register_upserts_devices_and_paths(admin: PooldClient, agent: Agent) -> None:
    status = admin.status()
    assert [h.name for h in status.hosts] == ["h1"]
    assert status.hosts[0].status == "up"
    assert status.hosts[0].last_heartbeat_at is not None
    [dev] = status.devices
    assert (dev.uid, dev.kind, dev.media, dev.state) == (
        "h1/emulated:0",
        "emulated",
        "emulated",
        "online",
    )
    assert dev.hosts == ["h1"] and dev.local_names == ["memfd"]
    assert (dev.capacity_bytes, dev.free_bytes, dev.leased_bytes) == (64 * MiB, 64 * MiB, 0)

    # Register again with a changed device and a second one: updated, not duplicated.
    bigger = EMULATED.model_copy(update={"capacity_bytes": 128 * MiB, "local_name": "memfd0"})
    second = EMULATED.model_copy(update={"uid": "h1/emulated:1"})
    agent.client.register(Heartbeat(inventory=[bigger, second]))
    devices = {d.uid: d for d in admin.status().devices}
    assert set(devices) == {"h1/emulated:0", "h1/emulated:1"}
    assert devices["h1/emulated:0"].capacity_bytes == 128 * MiB
    assert devices["h1/emulated:0"].local_names == ["memfd0"]


def test_device_absent_from_later_register_is_missing(admin: PooldClient, agent: Agent) -> None:
    second = EMULATED.model_copy(update={"uid": "h1/emulated:1"})
    agent.client.register(Heartbeat(inventory=[EMULATED, second]))
    agent.client.register(Heartbeat(inventory=[EMULATED]))
    devices = {d.uid: d for d in admin.status().devices}
    assert devices["h1/emulated:1"].state == "missing"
    assert devices["h1/emulated:1"].hosts == []
    assert devices["h1/emulated:0"].state == "online"
    # Back in the inventory, it is online again.
    agent.client.register(Heartbeat(inventory=[EMULATED, second]))
    assert {d.uid: d.state for d in admin.status().devices}["h1/emulated:1"] == "online"


def test_register_needs_inventory(agent: Agent) -> None:
    from poold.errors import BadRequest

    with pytest.raises(BadRequest):
        agent.client.register(Heartbeat())


# --- the lease lifecycle --------------------------------------------------------


def test_grant_activate_renew_release(admin: PooldClient, agent: Agent) -> None:
    lease = agent.client.grant(GRANT.model_copy(update={"labels": {"model": "llama"}}))
    assert lease.state == "granted"
    assert (lease.offset_bytes, lease.length_bytes, lease.requested_bytes) == (0, 4 * MiB, 3 * MiB)
    assert (lease.tenant, lease.host, lease.device_uid, lease.device_kind) == (
        "t1",
        "h1",
        "h1/emulated:0",
        "emulated",
    )
    assert lease.labels == {"model": "llama"} and lease.holder_pid == 4242

    active = agent.client.activate(lease.id)
    assert active.state == "active" and active.activated_at is not None
    renewed = agent.client.renew(lease.id, ttl_s=600)
    assert renewed.ttl_s == 600 and renewed.expires_at > active.expires_at

    status = admin.status()
    assert (status.capacity_bytes, status.leased_bytes, status.free_bytes) == (
        64 * MiB,
        4 * MiB,
        60 * MiB,
    )
    assert status.hosts[0].live_leases == 1 and status.hosts[0].leased_bytes == 4 * MiB
    assert status.devices[0].largest_free_bytes == 60 * MiB

    assert [x.id for x in agent.client.list_leases(live=True)] == [lease.id]
    assert agent.client.show_lease(lease.id).state == "active"
    assert admin.show_lease(lease.id).state == "active"

    released = agent.client.release(lease.id, reason="done")
    assert released.state == "released" and released.ended_at is not None
    assert agent.client.list_leases(live=True) == []
    assert [x.state for x in admin.list_leases(states=["released"])] == ["released"]
    assert admin.status().free_bytes == 64 * MiB


def test_grant_activate_in_one_step_and_abort(agent: Agent) -> None:
    active = agent.client.grant(GRANT.model_copy(update={"activate": True}))
    assert active.state == "active"
    granted = agent.client.grant(GRANT)
    aborted = agent.client.abort(granted.id, reason="memfd failed")
    assert aborted.state == "aborted"


def test_agent_ops_and_heartbeat_renewals(agent: Agent) -> None:
    a = agent.client.grant(GRANT.model_copy(update={"activate": True}))
    b = agent.client.grant(GRANT)
    reply = agent.client.heartbeat(
        Heartbeat(renewals=[Renewal(lease_id=a.id, ttl_s=300), Renewal(lease_id="nope", ttl_s=5)])
    )
    assert [(r.lease_id, r.code) for r in reply.renewed] == [
        (a.id, None),
        ("nope", "unknown_lease"),
    ]
    results = agent.client.apply_ops(
        [LeaseOp(lease_id=a.id, op="release"), LeaseOp(lease_id=b.id, op="abort")]
    )
    assert [(r.state, r.code) for r in results] == [("released", None), ("aborted", None)]


def test_an_op_batch_replayed_with_its_request_id_gets_the_first_answer(agent: Agent) -> None:
    """A batch whose reply was lost is re-sent under its id: answered, not applied again."""
    lease = agent.client.grant(GRANT.model_copy(update={"activate": True}))
    ops = [LeaseOp(lease_id=lease.id, op="release")]
    first = agent.client.apply_ops(ops, request_id="batch-1")
    again = agent.client.apply_ops(ops, request_id="batch-1")
    assert [(r.state, r.code) for r in first] == [("released", None)]
    assert again == first
    # Without the id the same op is applied again, and refused: the lease has ended.
    assert agent.client.apply_ops(ops)[0].code == "lease_not_active"


def test_agent_sees_only_its_own_leases(
    agent: Agent, other_agent: Agent, admin: PooldClient
) -> None:
    mine = agent.client.grant(GRANT)
    theirs = other_agent.client.grant(GRANT)
    assert [x.id for x in agent.client.list_leases()] == [mine.id]
    assert [x.id for x in agent.client.list_leases(host="h2")] == [mine.id]
    assert {x.id for x in admin.list_leases()} == {mine.id, theirs.id}
    assert [x.id for x in admin.list_leases(host="h2")] == [theirs.id]


# --- authentication and authorisation --------------------------------------------


def test_no_or_bad_token_is_unauthorized(raw: Raw, api: ThreadedServer) -> None:
    for token in (None, "not-a-token"):
        for method, path in [("GET", "/v1/status"), ("GET", "/v1/leases"), ("GET", "/v1/tenants")]:
            resp = raw.request(method, path, token=token)
            assert resp.status_code == 401, (token, path)
            assert resp.json()["code"] == "unauthorized"
    for header in ("Basic abc", "Bearer", "bearer"):
        resp = raw.http.get("/v1/status", headers={"authorization": header})
        assert resp.status_code == 401, header
        assert resp.json()["code"] == "unauthorized"
    with PooldClient(api.url, "pa1.h1.forged") as forged, pytest.raises(Unauthorized):
        forged.grant(GRANT)


def test_agent_token_on_admin_endpoints_is_forbidden(agent: Agent) -> None:
    c = agent.client
    calls = [
        c.status,
        c.list_tenants,
        c.list_hosts,
        lambda: c.get_tenant("t1"),
        lambda: c.create_tenant(TenantSpec(name="x", quota_bytes=0)),
        lambda: c.update_tenant("t1", TenantUpdate(quota_bytes=0)),
        lambda: c.delete_tenant("t1"),
        lambda: c.add_host("h5"),
    ]
    for call in calls:
        with pytest.raises(Forbidden):
            call()


def test_admin_on_agent_endpoints_is_forbidden(admin: PooldClient, agent: Agent) -> None:
    lease = agent.client.grant(GRANT)
    calls = [
        lambda: admin.register(Heartbeat(inventory=[EMULATED])),
        lambda: admin.heartbeat(Heartbeat()),
        lambda: admin.grant(GRANT),
        lambda: admin.activate(lease.id),
        lambda: admin.renew(lease.id),
        lambda: admin.abort(lease.id),
        lambda: admin.apply_ops([LeaseOp(lease_id=lease.id, op="release")]),
    ]
    for call in calls:
        with pytest.raises(Forbidden):
            call()
    assert agent.client.show_lease(lease.id).state == "granted"
