"""`poolctl hosts delete --force` with real poold, agent, poolrun and tenant processes: the
host's leases are revoked through the agent first (its tenants told, a poolrun CMD
signalled, the agent holding nothing), and only then is the host deleted."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from agent.client import Lease, PoolClient
from tests.e2e.conftest import Cluster
from tests.e2e.test_poolrun import cmd, poolrun_argv, wait_line


def test_force_revokes_through_the_agent_then_deletes(cluster: Cluster, tmp_path: Path) -> None:
    done = tmp_path / "cmd-ended"
    script = f"""
        import os, signal, sys, time
        def ended(s, f):
            open({str(done)!r}, "w").write(str(s))
            sys.exit(0)
        signal.signal(signal.SIGTERM, ended)
        print(os.environ["POOLD_LEASE_ID"], flush=True)
        time.sleep(60)
    """
    runner = subprocess.Popen(
        poolrun_argv(cluster, "--size", "2MiB", "--", *cmd(script)),
        stdout=subprocess.PIPE,
        text=True,
    )
    told = {"revoked": threading.Event(), "lost": threading.Event()}

    def on_lost(lease: Lease) -> None:
        told["lost"].set()
        lease.release()  # as a tenant does: let go of the memory

    try:
        run_lease = wait_line(runner)
        with PoolClient(cluster.socket_path) as tenant:
            mine = tenant.lease(
                2 << 20,
                ttl_s=30,
                on_revoke=lambda _lease, _at: told["revoked"].set(),
                on_lost=on_lost,
            )
            assert tenant.stats().leases_held == 2
            started = time.monotonic()
            out = cluster.poolctl("hosts", "delete", cluster.host, "--force", "--json")
            assert out.returncode == 0, out.stderr
            assert time.monotonic() - started < 30
            # The tenant was told before the host went (lost: revoked due now, so the
            # agent tore it down at once), and poolrun signalled its CMD.
            assert told["lost"].is_set()
            assert runner.wait(10) is not None
            assert done.read_text() == "15"  # SIGTERM, poolrun's default --revoke-signal
            # The agent holds nothing (its socket still answers: the process lives on).
            stats = tenant.stats()
            assert (stats.leases_held, stats.bytes_held, stats.revoked_held_leases) == (0, 0, 0)
    finally:
        runner.kill()
        runner.wait()
        assert runner.stdout is not None
        runner.stdout.close()
    report = json.loads(out.stdout)
    outcomes = {x["lease_id"]: (x["asked"], x["outcome"]) for x in report["leases"]}
    assert outcomes == {
        run_lease: ("revoked", "ended_before_deletion"),
        mine.lease_id: ("revoked", "ended_before_deletion"),
    }
    assert report["ended_leases"] == []  # nothing was left for the deletion to end
    for lease_id in (run_lease, mine.lease_id):
        assert cluster.admin.show_lease(lease_id).state == "reclaimed"
        events = [r for r in cluster.ledger_rows("events")["events"] if r[4] == lease_id]
        assert any("host deleted" in str(r) for r in events)
    assert [h.name for h in cluster.admin.list_hosts()] == []
    assert cluster.admin.status().leased_bytes == 0


def test_force_with_its_agent_down_ends_the_leases_with_the_host(cluster: Cluster) -> None:
    with PoolClient(cluster.socket_path) as tenant:
        held = tenant.lease(2 << 20, ttl_s=60, renew=False)
        # The agent dies holding it: nobody uses that memory through poold any more.
        cluster.agent.kill()
    out = cluster.poolctl("hosts", "delete", cluster.host, "--force", "--silent-s", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert "its agent does not answer" in out.stderr
    [outcome] = json.loads(out.stdout)["leases"]
    assert outcome["lease_id"] == held.lease_id
    assert (outcome["was"], outcome["outcome"]) == ("active", "ended_with_host")
    assert outcome["state"] == "reclaimed"
    assert [h.name for h in cluster.admin.list_hosts()] == []
