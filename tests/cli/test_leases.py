"""`poolctl leases revoke` and `release` against a real poold: a lease that has ended is
`lease_not_active` for both, in an administrator's words, never the state machine's
"no transition from reclaimed on revoke"."""

from __future__ import annotations

from poold.api.client import PooldClient
from poold.wire.agent import LeaseOp
from tests.cli.test_hosts_delete import piped
from tests.cli.test_lifecycle import agent, lease, poolctl
from tests.conftest import ThreadedServer

__all__ = ["agent"]  # the fixture: host h1 with one NUMA node, tenant t1


def test_revoke_and_release_of_an_ended_lease_are_lease_not_active(
    api: ThreadedServer, agent: PooldClient
) -> None:
    ended = lease(agent)
    [res] = agent.apply_ops([LeaseOp(lease_id=ended, op="release")])
    assert res.code is None, res
    for verb, extra in (("revoke", ["--reason", "x"]), ("release", [])):
        out = piped(api, "leases", verb, ended, *extra)
        assert out.returncode == 1, out
        assert out.stderr.startswith("poolctl: error[lease_not_active]: "), out.stderr
        assert "transition" not in out.stderr and len(out.stderr.splitlines()) == 1
    assert "has ended (released)" in piped(api, "leases", "revoke", ended, "--reason", "x").stderr


def test_revoke_of_a_revoking_lease_says_what_to_do(
    api: ThreadedServer, agent: PooldClient
) -> None:
    lease_id = lease(agent)
    assert poolctl(api, "leases", "revoke", lease_id, "--reason", "x").exit_code == 0
    r = poolctl(api, "leases", "revoke", lease_id, "--reason", "x")
    assert r.exit_code == 1 and "error[invalid_transition]" in r.output, r.output
    assert "leases end" in r.output and "no transition" not in r.output
