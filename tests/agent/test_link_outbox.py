"""PooldLink's outbox keeps what poold did not take: nothing queued is lost to a refusal
that a retry can fix (a credential not taken yet, poold failing mid-request)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agent.link import PooldLink
from poold.api.client import PooldClient
from poold.errors import QuotaExceeded, Unauthorized
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, LeaseOp, LeaseOpResult, LocalUse
from poold.wire.common import LeaseOut
from tests.conftest import ThreadedServer
from tests.poold.conftest import UID, device

MIB = 1 << 20


def test_ops_refused_for_the_credential_stay_queued(
    api: ThreadedServer, admin: PooldClient
) -> None:
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[UID]))
    good = PooldClient(api.url, credential)
    link = PooldLink(good, "test")
    link.register([device()])
    lease = link.grant(GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1, activate=True))
    link.enqueue(LeaseOp(lease_id=lease.id, op="release", reason="done"))
    wrong = PooldClient(api.url, "pa1.h1.not-the-credential")
    link.client = wrong
    try:
        with pytest.raises(Unauthorized):
            link.flush()
        assert link.outbox_size() == 1
    finally:
        wrong.close()
        link.client = good
    link.flush()
    assert link.outbox_size() == 0
    assert admin.show_lease(lease.id).state == "released"
    good.close()


def test_a_flush_sends_what_was_queued_not_what_queues_while_it_sends(
    api: ThreadedServer, admin: PooldClient
) -> None:
    """Ops keep arriving at the lease rate; a flush that chased them sent a few ops per
    round trip instead of one batch per flush interval."""
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[UID]))
    client = PooldClient(api.url, credential)
    link = PooldLink(client, "test")
    link.register([device()])
    first, later = (
        link.grant(GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1, activate=True))
        for _ in range(2)
    )
    sent: list[list[str]] = []
    apply_ops = client.apply_ops

    def sending(ops: list[LeaseOp], *, request_id: str | None = None) -> list[LeaseOpResult]:
        sent.append([op.lease_id for op in ops])
        if len(sent) == 1:  # an op queued while the first batch is on its way
            link.enqueue(LeaseOp(lease_id=later.id, op="release", reason="done"))
        return apply_ops(ops, request_id=request_id)

    client.apply_ops = sending  # type: ignore[method-assign]
    link.enqueue(LeaseOp(lease_id=first.id, op="release", reason="done"))
    link.flush()
    assert sent == [[first.id]] and link.outbox_size() == 1
    link.flush()
    assert sent == [[first.id], [later.id]] and link.outbox_size() == 0
    assert {admin.show_lease(x.id).state for x in (first, later)} == {"released"}
    client.close()


def test_an_op_refused_on_a_grants_way_is_heard_of_and_the_lease_kept_plain(
    api: ThreadedServer, admin: PooldClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Queued ops ride on a central grant; poold's answer says what became of each. One
    refused there used to vanish (a refused local grant: memory the ledger never counted,
    found only when the heartbeat's holdings disagreed)."""
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[UID]))
    client = PooldClient(api.url, credential)
    link = PooldLink(client, "test")
    link.register([device()])
    req = GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1, activate=True)
    first = link.grant(req)
    link.enqueue(LeaseOp(lease_id=first.id, op="release", reason="done"))
    link.enqueue(LeaseOp(lease_id="no-such-lease", op="release", reason="done"))
    with caplog.at_level("WARNING", logger="pool_agent.link"):
        second = link.grant(req)
    assert link.outbox_size() == 0
    assert admin.show_lease(first.id).state == "released"
    refused = [r.getMessage() for r in caplog.records if "refused the queued op" in r.getMessage()]
    assert len(refused) == 1 and "no-such-lease" in refused[0] and "unknown_lease" in refused[0]
    # What the agent keeps (journals, lists, re-reads) is the lease alone.
    assert type(second) is LeaseOut
    assert LeaseOut.model_validate_json(second.model_dump_json()) == second
    client.close()


def test_ops_riding_on_a_refused_grant_are_heard_of_too(
    api: ThreadedServer, admin: PooldClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The grant is refused (the quota is full) after the ops that rode on it were
    applied: its error carries their results, so one refused there is heard of (a
    refused local grant dropped that way stayed uncommitted until its tenant lost it)."""
    credential = admin.add_host("h1").credential
    admin.create_tenant(
        TenantSpec(name="t1", quota_bytes=2 * MIB, quota_leases=1, allowed_uids=[UID])
    )
    client = PooldClient(api.url, credential)
    link = PooldLink(client, "test")
    link.register([device()])
    req = GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1, activate=True)
    first = link.grant(req)
    link.enqueue(LeaseOp(lease_id="no-such-lease", op="release", reason="done"))
    with caplog.at_level("WARNING", logger="pool_agent.link"), pytest.raises(QuotaExceeded) as info:
        link.grant(req)
    assert [r["code"] for r in info.value.detail["pending"]] == ["unknown_lease"]
    assert link.outbox_size() == 0
    assert admin.show_lease(first.id).state == "active"
    refused = [r.getMessage() for r in caplog.records if "refused the queued op" in r.getMessage()]
    assert len(refused) == 1 and "no-such-lease" in refused[0] and "unknown_lease" in refused[0]
    client.close()


def test_a_refused_final_flush_is_one_line_without_a_traceback(
    api: ThreadedServer, admin: PooldClient, caplog: pytest.LogCaptureFixture
) -> None:
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[UID]))
    with PooldClient(api.url, credential) as client:
        link = PooldLink(client, "test")
        link.register([device()])
        lease = link.grant(
            GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1, activate=True)
        )
        admin.delete_host("h1", force=True)  # the credential is dead from here
        link.enqueue(LeaseOp(lease_id=lease.id, op="release", reason="done"))
        with caplog.at_level(logging.INFO, logger="pool_agent"):
            link.stop()
    [line] = [r for r in caplog.records if "final outbox flush" in r.getMessage()]
    assert line.levelno == logging.WARNING and line.exc_info is None
    assert "unauthorized" in line.getMessage()


class _LocalOf:
    """The link's view of the agent's local leases (agent/local_grants.py), by tenant."""

    def __init__(self, tenants: dict[str, str], *, enabled: bool = True) -> None:
        self.tenants = tenants
        self.queued: list[str] = []
        self.enabled = enabled

    def is_local(self, lease_id: str) -> bool:
        return lease_id in self.tenants

    def tenant_of(self, lease_id: str) -> str | None:
        return self.tenants.get(lease_id)

    def on_enqueue(self, op: LeaseOp) -> None:
        pass

    def on_queued(self, op: LeaseOp) -> None:
        self.queued.append(op.lease_id)

    def on_delivered(self, ops: list[LeaseOp]) -> None:
        pass

    def riding_use(self, use: LocalUse, riding: list[LeaseOp]) -> LocalUse:
        return use


def test_a_tenants_local_ops_reach_poold_one_request_at_a_time_in_queue_order() -> None:
    """A local grant may spend the budget a release queued before it freed: while that
    release is on its way (riding on a central grant), the grant queued after it waits,
    and other tenants' ops do not."""
    with PooldClient("http://127.0.0.1:9", "x" * 32) as client:  # never asked here
        link = PooldLink(client, "test")
        local = _LocalOf({"a": "t", "b": "t", "c": "u"})
        link.local = local  # type: ignore[assignment]
        link.enqueue(LeaseOp(lease_id="a", op="release", reason="holder released"))
        assert local.queued == ["a"]  # told once it is in line, not before
        riding = link.ops.take(local.tenant_of, for_tenant="t")  # a central grant of t
        assert [op.lease_id for op in riding] == ["a"]
        link.enqueue(LeaseOp(lease_id="b", op="release", reason="holder released"))
        link.enqueue(LeaseOp(lease_id="c", op="release", reason="holder released"))
        flushed = link.ops.take(local.tenant_of)
        assert [op.lease_id for op in flushed] == ["c"]  # b waits for a's request
        link.ops.delivered(riding)
        link.ops.delivered(flushed)
        after = link.ops.take(local.tenant_of)
        assert [op.lease_id for op in after] == ["b"]


def test_a_central_grant_wakes_the_outbox_only_for_the_ops_it_held_back(
    api: ThreadedServer, admin: PooldClient
) -> None:
    """Other tenants' local ops keep their flush interval: waking the outbox after every
    central grant because anything was queued sent poold a batch per central grant.
    An op queued meanwhile for a lease whose op rode on the grant goes at once."""
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[UID]))
    client = PooldClient(api.url, credential)
    link = PooldLink(client, "test")
    link.register([device()])
    link.local = _LocalOf({"elsewhere": "u"})  # type: ignore[assignment]

    def grant() -> LeaseOut:
        return link.grant(
            GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1, activate=True)
        )

    first = grant()
    link.enqueue(LeaseOp(lease_id="elsewhere", op="release", reason="holder released"))
    link._wake.clear()
    grant()  # "elsewhere" is another tenant's local lease: it stays queued, not held back
    assert not link._wake.is_set()
    assert [op.lease_id for op in link.ops.queued()] == ["elsewhere"]

    link.enqueue(LeaseOp(lease_id=first.id, op="release_dirty", reason="holder released"))
    link._wake.clear()
    sent = link._grant_retrying

    def meanwhile(req: GrantRequest) -> Any:
        assert [op.lease_id for op in req.pending] == [first.id]  # it rides
        link.enqueue(LeaseOp(lease_id=first.id, op="scrubbed", reason="zeroed"))
        link._wake.clear()  # as if the flush loop had looked and found it held back
        return sent(req)

    link._grant_retrying = meanwhile  # type: ignore[method-assign]
    grant()
    assert link._wake.is_set()  # the scrub that waited for the release goes now
    assert {op.lease_id for op in link.ops.queued()} == {"elsewhere", first.id}
    client.close()


@pytest.mark.parametrize("delegating", [True, False])
def test_a_central_release_waits_for_the_flush_interval_only_while_the_host_delegates(
    delegating: bool,
) -> None:
    """Under delegation a batch woken per central lease's release was most of poold's
    batches (bench/scale.py --delegation): it waits for the next flush, or rides on its
    tenant's next grant. Other ops of central leases, and every op without delegation,
    still wake the outbox at once."""
    with PooldClient("http://127.0.0.1:9", "x" * 32) as client:  # never asked here
        link = PooldLink(client, "test")
        link.local = _LocalOf({}, enabled=delegating)  # type: ignore[assignment]
        link.enqueue(LeaseOp(lease_id="central", op="release", reason="holder released"))
        assert link._wake.is_set() is not delegating
        link._wake.clear()
        link.enqueue(LeaseOp(lease_id="other", op="release_dirty", reason="holder released"))
        assert link._wake.is_set()
