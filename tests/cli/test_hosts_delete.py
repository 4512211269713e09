"""`poolctl hosts delete [--force]` against a real poold: refused while the host holds live
leases, its credential dead at once after, its devices out of placement; through click's
runner and as a real process whose stdout is a pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from poold.api.client import PooldClient
from poold.errors import Unauthorized
from poold.wire.agent import Heartbeat, InventoryDevice
from tests.cli.test_lifecycle import agent, lease, poolctl
from tests.conftest import ADMIN_TOKEN, ThreadedServer
from tests.poold.conftest import MiB

__all__ = ["agent"]  # the fixture: host h1 with one NUMA node, tenant t1

ROOT = Path(__file__).resolve().parents[2]


def piped(api: ThreadedServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "POOLD_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "cli", "--url", api.url, "--token", ADMIN_TOKEN, *args],
        capture_output=True,  # stdout is a pipe
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_refused_while_leases_live_then_forced(
    api: ThreadedServer, agent: PooldClient, admin: PooldClient
) -> None:
    held = lease(agent)
    pending = lease(agent, activate=False)
    r = poolctl(api, "hosts", "delete", "h1")
    assert r.exit_code == 1
    assert r.stderr.startswith("poolctl: error[host_busy]: ") and "2 live lease(s)" in r.stderr
    agent.heartbeat(Heartbeat())  # the credential still works: nothing changed

    # This agent never heartbeats again: after --silent-s it is taken as gone, and the
    # revoked lease it never confirmed is ended by the deletion.
    r = poolctl(api, "hosts", "delete", "h1", "--force", "--silent-s", "0.5", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["ended_leases"] == [held]
    assert out["devices_missing"] == ["h1/numa:node3"] and out["history_kept"] is True
    assert sorted((x["lease_id"], x["was"], x["asked"], x["outcome"]) for x in out["leases"]) == (
        sorted(
            [
                (held, "active", "revoked", "ended_with_host"),
                (pending, "granted", "aborted", "ended_before_deletion"),
            ]
        )
    )
    assert "its agent does not answer" in r.stderr
    assert admin.show_lease(held).state == "reclaimed"
    assert admin.show_lease(pending).state == "aborted"
    # The agent's next heartbeat gets what an unknown credential gets, at once.
    with pytest.raises(Unauthorized):
        agent.heartbeat(Heartbeat())
    assert [h.name for h in admin.list_hosts()] == []
    [dev] = admin.status().devices
    assert (dev.state, dev.hosts) == ("missing", [])
    # Deleting it again: unknown_host, exit 1, like `tenants delete`.
    r = poolctl(api, "hosts", "delete", "h1")
    assert r.exit_code == 1 and r.stderr.startswith("poolctl: error[unknown_host]: ")
    # The name is free for a new host, whose agent gets its own device back.
    r = poolctl(api, "hosts", "add", "h1", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["name"] == "h1"
    with PooldClient(api.url, json.loads(r.stdout)["credential"]) as again:
        reply = again.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid="h1/numa:node3",
                        kind="numa",
                        capacity_bytes=256 * MiB,
                        local_name="node3",
                        numa_node=3,
                        health="ok",
                    )
                ]
            )
        )
    assert reply.inventory_errors == []
    [dev] = admin.status().devices
    assert (dev.state, dev.hosts) == ("online", ["h1"])


def test_a_host_without_leases_goes_and_says_so_through_a_pipe(
    api: ThreadedServer, admin: PooldClient
) -> None:
    admin.add_host("idle")
    out = piped(api, "hosts", "delete", "idle")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "host idle deleted\n" and out.stderr == ""
    out = piped(api, "hosts", "delete", "idle")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("poolctl: error[unknown_host]: ")
    assert len(out.stderr.splitlines()) == 1


def test_force_waits_for_an_answering_agent_and_never_deletes_under_it(
    api: ThreadedServer, agent: PooldClient, admin: PooldClient
) -> None:
    """An agent that heartbeats but keeps its lease: the host is not deleted under it."""
    held = lease(agent)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            agent.heartbeat(Heartbeat(held=[held]))

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        out = piped(api, "hosts", "delete", "h1", "--force", "--wait-s", "1.5")
    finally:
        stop.set()
        beater.join()
    assert out.returncode == 1 and out.stdout == "", out
    [*progress, error] = out.stderr.splitlines()
    assert error.startswith("poolctl: error[host_busy]: host 'h1' still holds 1 live lease(s)")
    assert all(x.startswith("poolctl: host h1: waiting for its agent") for x in progress)
    # The host stays, draining, its lease revoked: the agent was told and still answers.
    [host] = admin.list_hosts()
    assert host.status == "draining"
    assert admin.show_lease(held).state == "revoking"
    assert [x.lease_id for x in agent.heartbeat(Heartbeat()).revocations] == [held]


def test_wait_options_go_with_force(api: ThreadedServer, admin: PooldClient) -> None:
    admin.add_host("idle")
    r = poolctl(api, "hosts", "delete", "idle", "--wait-s", "5")
    assert r.exit_code == 2 and "error[usage]: --wait-s goes with --force" in r.stderr
    assert [h.name for h in admin.list_hosts()] == ["idle"]
