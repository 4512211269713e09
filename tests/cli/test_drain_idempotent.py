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


def test_a_repeated_drain_keeps_the_deadline_it_set(
    api: ThreadedServer, agent: PooldClient
) -> None:
    """A cron re-running `devices drain --deadline-s N` must not move the deadline on."""
    lease(agent)
    first = json.loads(
        poolctl(api, "devices", "drain", "node3", "--deadline-s", "60", "--json").stdout
    )
    for deadline_s in ("60", "3600"):
        r = poolctl(api, "devices", "drain", "node3", "--deadline-s", deadline_s, "--json")
        assert r.exit_code == 0, r.output
        again = json.loads(r.stdout)
        assert (again["changed"], again["deadline_at"]) == (False, first["deadline_at"])
    out = piped(api, "devices", "drain", "node3", "--deadline-s", "60")
    assert out.returncode == 0 and out.stdout.endswith("nothing changed (it already was)\n")
    r = poolctl(api, "devices", "drain", "node3", "--deadline-s", "10", "--json")
    sooner = json.loads(r.stdout)
    assert sooner["changed"] is True and sooner["deadline_at"] < first["deadline_at"]
    host = json.loads(poolctl(api, "hosts", "drain", "h1", "--deadline-s", "60", "--json").stdout)
    r = poolctl(api, "hosts", "drain", "h1", "--deadline-s", "120", "--json")
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["changed"], json.loads(r.stdout)["deadline_at"]) == (
        False,
        host["deadline_at"],
    )


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
