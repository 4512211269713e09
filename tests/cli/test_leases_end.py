"""`poolctl leases end LEASE_ID...` against a real poold: an orphaned lease ends at once and
frees the tenant's quota; a held one is revoked due now and its agent learns it in the next
heartbeat reply; through click's runner and as a real process whose stdout is a pipe."""

from __future__ import annotations

import json
import logging

import pytest

from poold.api.client import PooldClient
from poold.errors import QuotaExceeded
from poold.wire.admin import TenantUpdate
from poold.wire.agent import GrantRequest, Heartbeat, LeaseOp
from tests.cli.test_hosts_delete import piped
from tests.cli.test_lifecycle import agent, lease, poolctl
from tests.conftest import ThreadedServer

__all__ = ["agent"]  # the fixture: host h1 with one NUMA node, tenant t1

MiB = 1 << 20


def test_an_orphaned_lease_ends_and_frees_the_quota(
    api: ThreadedServer, agent: PooldClient, admin: PooldClient, caplog: pytest.LogCaptureFixture
) -> None:
    admin.update_tenant("t1", TenantUpdate(quota_leases=1))
    orphan = lease(agent)
    [res] = agent.apply_ops([LeaseOp(lease_id=orphan, op="orphan", reason="holder died")])
    assert res.state == "orphaned"
    with pytest.raises(QuotaExceeded):
        lease(agent)
    with caplog.at_level(logging.INFO, logger="poold.ledger.admin_ops"):
        r = poolctl(api, "leases", "end", orphan, "--reason", "gone for good")
    assert r.exit_code == 0, r.output
    assert r.stdout == f"lease {orphan}: reclaimed (reclaimed)\n"
    [line] = [m for m in caplog.messages if orphan in m]
    assert "orphaned -> reclaimed" in line and "gone for good" in line
    assert lease(agent)  # the tenant may lease again


def test_a_held_lease_is_fenced_until_its_agent_confirms(
    api: ThreadedServer, agent: PooldClient, admin: PooldClient
) -> None:
    held = lease(agent)
    r = poolctl(api, "leases", "end", held, "--json")
    assert r.exit_code == 0, r.output
    [out] = json.loads(r.stdout)
    assert (out["lease_id"], out["action"], out["changed"]) == (held, "revoked", True)
    assert out["lease"]["state"] == "revoking"
    # The bytes stay taken: the next lease is placed after them.
    x = admin.show_lease(held)
    other = agent.grant(GrantRequest(size_bytes=8 * MiB, uid=1000, pid=7, activate=True))
    assert other.offset_bytes >= x.offset_bytes + x.length_bytes
    [revocation] = [v for v in agent.heartbeat(Heartbeat()).revocations if v.lease_id == held]
    assert revocation.deadline_at is not None
    [confirmed] = agent.confirm_revoked([held])
    assert confirmed.state == "reclaimed"


def test_several_ids_each_on_its_own_through_a_pipe(
    api: ThreadedServer, agent: PooldClient
) -> None:
    first = lease(agent)
    agent.release(first)
    second = lease(agent, activate=False)
    out = piped(api, "leases", "end", first, "nope", second)
    assert out.returncode == 1  # one of them could not be ended
    assert out.stdout.splitlines() == [
        f"lease {first}: already released; nothing changed",
        f"lease {second}: aborted (aborted)",
    ]
    [error] = out.stderr.splitlines()
    assert error.startswith("poolctl: error[unknown_lease]: lease nope: ")
    out = piped(api, "leases", "end")
    assert out.returncode == 2 and "LEASE_ID" in out.stderr


def test_json_lists_errors_too(api: ThreadedServer, agent: PooldClient) -> None:
    held = lease(agent)
    r = poolctl(api, "--format", "json", "leases", "end", "nope", held)
    assert r.exit_code == 1
    results = json.loads(r.stdout)
    assert results[0] == {
        "lease_id": "nope",
        "error": {
            "code": "unknown_lease",
            "message": "no lease 'nope'",
            "detail": {"lease_id": "nope"},
        },
    }
    assert results[1]["action"] == "revoked"
