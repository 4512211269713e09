"""`POST /v1/agent/delegation` over HTTP, and local grants in op batches: the agent's
delegation as the API hands it out, with stable codes for what it refuses."""

from __future__ import annotations

import pytest

from poold.api.client import PooldClient
from poold.errors import PoolError
from poold.wire.agent import Heartbeat, LeaseOp
from poold.wire.delegation import (
    BudgetWant,
    DelegationRequest,
    ReserveWant,
)
from tests.conftest import ThreadedServer
from tests.poold.api.conftest import Agent, Raw
from tests.poold.api.test_metrics import scrape
from tests.poold.conftest import MiB, local_grant_op


def test_delegate_reserve_grant_locally_and_give_back(agent: Agent, admin: PooldClient) -> None:
    d = agent.client.delegate(
        DelegationRequest(
            request_id="d-1",
            reserve=[ReserveWant(bytes=8 * MiB)],
            budgets=[BudgetWant(tenant="t1", bytes=8 * MiB, leases=2)],
        )
    )
    (res,) = d.reservations
    assert (res.device_uid, res.length_bytes) == ("h1/emulated:0", 8 * MiB)
    assert [(b.tenant, b.bytes, b.leases) for b in d.budgets] == [("t1", 8 * MiB, 2)]
    # A retry of the request id is answered, not applied again.
    assert (
        agent.client.delegate(
            DelegationRequest(request_id="d-1", reserve=[ReserveWant(bytes=8 * MiB)])
        )
        == d
    )

    (result,) = agent.client.apply_ops([local_grant_op(d, "local-1")])
    assert (result.state, result.code) == ("active", None)
    listed = {x.id: x for x in admin.list_leases()}
    assert listed["local-1"].host == "h1"
    assert listed["local-1"].epoch == res.epoch_base

    # The heartbeat reply carries the delegation, renewed.
    reply = agent.client.heartbeat(Heartbeat(agent_version="test"))
    assert reply.delegation is not None
    assert [r.id for r in reply.delegation.reservations] == [res.id]
    assert reply.delegation.reservations[0].expires_at >= res.expires_at

    # Give-back is refused while a lease lies inside, with its code over the wire.
    with pytest.raises(PoolError) as info:
        agent.client.delegate(DelegationRequest(give_back=[res.id]))
    assert info.value.code == "reservation_in_use"
    (done,) = agent.client.apply_ops([LeaseOp(lease_id="local-1", op="release")])
    assert done.code is None
    assert agent.client.delegate(DelegationRequest(give_back=[res.id])).reservations == []


def test_local_grant_refusals_are_per_op(agent: Agent, other_agent: Agent) -> None:
    d = agent.client.delegate(DelegationRequest(reserve=[ReserveWant(bytes=4 * MiB)]))
    # No budget for the tenant on this host; the other host does not hold the reservation.
    assert [r.code for r in agent.client.apply_ops([local_grant_op(d, "a")])] == ["budget_exceeded"]
    assert [r.code for r in other_agent.client.apply_ops([local_grant_op(d, "b")])] == ["not_owner"]


def test_delegation_needs_an_agent_and_a_valid_body(raw: Raw, agent: Agent) -> None:
    resp = raw.request("POST", "/v1/agent/delegation", json={})
    assert resp.status_code == 403
    resp = raw.request(
        "POST", "/v1/agent/delegation", token=agent.credential, json={"reserve": [{"bytes": 0}]}
    )
    assert resp.status_code == 400
    resp = raw.request(
        "POST",
        "/v1/agent/delegation",
        token=agent.credential,
        json={"reserve": [{"bytes": 2097152, "device_uid": "nope"}]},
    )
    assert (resp.status_code, resp.json()["code"]) == (404, "unknown_device")


def test_metrics_show_the_delegation(api: ThreadedServer, agent: Agent) -> None:
    agent.client.delegate(
        DelegationRequest(
            reserve=[ReserveWant(bytes=8 * MiB)],
            budgets=[BudgetWant(tenant="t1", bytes=4 * MiB, leases=2)],
        )
    )
    got = scrape(api.url)
    dev = (("device", "h1/emulated:0"),)
    assert got[("poold_device_delegated_bytes", dev)] == 8 * MiB
    assert got[("poold_device_delegated_unleased_bytes", dev)] == 8 * MiB
    assert got[("poold_device_free_bytes", dev)] == 56 * MiB
    assert got[("poold_host_delegated_bytes", (("host", "h1"),))] == 8 * MiB
    assert got[("poold_tenant_budget_bytes", (("tenant", "t1"),))] == 4 * MiB
    assert got[("poold_tenant_budget_leases", (("tenant", "t1"),))] == 2
