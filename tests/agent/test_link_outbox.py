"""PooldLink's outbox keeps what poold did not take: nothing queued is lost to a refusal
that a retry can fix (a credential not taken yet, poold failing mid-request)."""

from __future__ import annotations

import pytest

from agent.link import PooldLink
from poold.api.client import PooldClient
from poold.errors import Unauthorized
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, LeaseOp
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
