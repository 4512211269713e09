"""poolctl against a real poold API (uvicorn on loopback), on both ledger backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from cli.poolctl import main
from cli.units import format_size, parse_size
from poold.api.client import PooldClient
from poold.ledger import migrate
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice
from tests.conftest import ADMIN_TOKEN, ThreadedServer


def poolctl(api: ThreadedServer, *args: str) -> Result:
    return CliRunner().invoke(
        main, ["--url", api.url, "--token", ADMIN_TOKEN, *args], env={"COLUMNS": "200"}
    )


def test_sizes_parse_and_format() -> None:
    assert parse_size("64GiB") == 64 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1048576") == 1 << 20
    assert parse_size("1.5G") == 3 << 29
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert format_size(64 << 30) == "64.0 GiB"


def test_tenants_hosts_leases_status(api: ThreadedServer, tmp_path: Path) -> None:
    r = poolctl(
        api,
        "tenants",
        "add",
        "alpha",
        "--quota",
        "1GiB",
        "--max-leases",
        "4",
        "--uid",
        "1000",
        "--gid",
        "100",
    )
    assert r.exit_code == 0, r.output
    r = poolctl(api, "tenants", "list", "--json")
    (t,) = json.loads(r.output)
    assert t["name"] == "alpha" and t["quota_bytes"] == 1 << 30 and t["allowed_uids"] == [1000]
    r = poolctl(api, "tenants", "set-quota", "alpha", "--bytes", "2GiB", "--leases", "8")
    assert r.exit_code == 0, r.output
    assert (
        json.loads(poolctl(api, "tenants", "show", "alpha", "--json").output)["quota_bytes"]
        == 2 << 30
    )

    cred_file = tmp_path / "cred"
    r = poolctl(api, "hosts", "add", "rack1-h1", "--credential-file", str(cred_file))
    assert r.exit_code == 0, r.output
    assert cred_file.stat().st_mode & 0o777 == 0o600
    (h,) = json.loads(poolctl(api, "hosts", "list", "--json").output)
    assert h["name"] == "rack1-h1"

    with PooldClient(api.url, cred_file.read_text().strip()) as agent:
        agent.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid="emulated:rack1-h1",
                        kind="emulated",
                        media="emulated",
                        capacity_bytes=1 << 30,
                    )
                ]
            )
        )
        lease = agent.grant(GrantRequest(size_bytes=3 << 20, uid=1000, pid=42, activate=True))

    st = json.loads(poolctl(api, "status", "--json").output)
    assert st["leased_bytes"] == 4 << 20  # rounded up to the 2 MiB alignment
    assert st["devices"][0]["free_bytes"] == (1 << 30) - (4 << 20)
    r = poolctl(api, "status")
    assert r.exit_code == 0 and "rack1-h1" in r.output and "emulated" in r.output

    (row,) = json.loads(poolctl(api, "leases", "list", "--json").output)
    assert row["id"] == lease.id and row["state"] == "active"
    assert (
        json.loads(poolctl(api, "leases", "show", lease.id, "--json").output)["tenant"] == "alpha"
    )
    r = poolctl(api, "leases", "release", lease.id, "--reason", "test")
    assert r.exit_code == 0 and "released" in r.output
    r = poolctl(api, "leases", "release", lease.id)
    assert r.exit_code == 1
    assert "error[lease_not_active]" in r.output


def test_errors_are_one_line_with_code_and_nonzero(api: ThreadedServer) -> None:
    r = poolctl(api, "tenants", "show", "ghost")
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        "poolctl: error[unknown_tenant]: no tenant named 'ghost'"
    ]
    r = CliRunner().invoke(main, ["--url", api.url, "--token", "nope", "status"])
    assert r.exit_code == 1 and "error[unauthorized]" in r.output
    r = poolctl(api, "tenants", "add", "bad", "--quota", "lots")
    assert r.exit_code == 2


def test_db_upgrade_creates_the_schema(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["db", "upgrade", "--state-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "ledger.db").exists()
    r = CliRunner().invoke(main, ["db", "current", "--state-dir", str(tmp_path)])
    head = migrate.head_revision(f"sqlite:///{tmp_path / 'ledger.db'}")
    assert f"current: {head}  head: {head}" in r.output


def test_unreachable_poold_is_a_coded_error(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["--url", "http://127.0.0.1:9", "--token", "x", "status"])
    assert r.exit_code == 1 and "error[poold_unreachable]" in r.output
