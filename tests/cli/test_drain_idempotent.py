"""Drain and undrain are idempotent both ways, for devices and hosts: a repeat succeeds
(exit 0) and says nothing changed (`changed: false`); through click's runner and a pipe."""

from __future__ import annotations

import json

from poold.api.client import PooldClient
from tests.cli.test_hosts_delete import piped
from tests.cli.test_lifecycle import agent, lease, poolctl
from tests.conftest import ThreadedServer

__all__ = ["agent"]  # the fixture: host h1 with NUMA node node3, tenant t1


def test_devices_undrain_twice(api: ThreadedServer, agent: PooldClient) -> None:
    r = poolctl(api, "devices", "drain", "node3", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["changed"] is True
    r = poolctl(api, "devices", "undrain", "node3", "--json")
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["state"], json.loads(r.stdout)["changed"]) == ("online", True)
    r = poolctl(api, "devices", "undrain", "node3", "--json")
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["state"], json.loads(r.stdout)["changed"]) == ("online", False)
    out = piped(api, "devices", "undrain", "node3")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "h1/numa:node3: online; nothing changed (it already was)\n"


def test_hosts_drain_and_undrain_twice(api: ThreadedServer, agent: PooldClient) -> None:
    first = json.loads(poolctl(api, "hosts", "drain", "h1", "--json").stdout)
    second = poolctl(api, "hosts", "drain", "h1", "--json")
    assert second.exit_code == 0, second.output
    assert (first["changed"], json.loads(second.stdout)["changed"]) == (True, False)
    out = piped(api, "hosts", "drain", "h1")
    assert out.returncode == 0 and out.stdout == "h1: draining; nothing changed (it already was)\n"
    # A deadline is news: it is set, so the drain writes.
    r = poolctl(api, "hosts", "drain", "h1", "--deadline-s", "60", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["changed"] is True
    r = poolctl(api, "hosts", "undrain", "h1", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["changed"] is True
    r = poolctl(api, "hosts", "undrain", "h1", "--json")
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["state"], json.loads(r.stdout)["changed"]) == ("up", False)
    out = piped(api, "hosts", "undrain", "h1")
    assert out.returncode == 0 and out.stdout == "h1: up; nothing changed (it already was)\n"


def test_devices_undrain_counts_the_live_leases(api: ThreadedServer, agent: PooldClient) -> None:
    lease(agent)
    lease(agent)
    poolctl(api, "devices", "drain", "node3", "--deadline-s", "600")
    r = poolctl(api, "devices", "undrain", "node3", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["live_leases"] == 2
    out = piped(api, "devices", "undrain", "node3")
    assert (
        out.stdout == "h1/numa:node3: online; 2 live lease(s); nothing changed (it already was)\n"
    )
