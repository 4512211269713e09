"""`poolctl devices map` against a real poold: the extents are the leases and reserved
ranges poold reports, and the strip and figures say the same (both ledgers)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result

from cli.poolctl import main
from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, InventoryDevice, LeaseOp
from tests.conftest import ADMIN_TOKEN, ThreadedServer

MiB = 1 << 20
CXL = "cxl:ram:serials=3,4:ways=2:gran=4096:size=536870912"
NODE = "h1/numa:node3"


def poolctl(api: ThreadedServer, *args: str) -> Result:
    return CliRunner().invoke(
        main, ["--url", api.url, "--token", ADMIN_TOKEN, *args], env={"COLUMNS": "250"}
    )


@pytest.fixture
def agent(api: ThreadedServer, admin: PooldClient) -> Iterator[PooldClient]:
    """A 512 MiB CXL device with its first 64 MiB reserved, a 256 MiB NUMA node, two tenants."""
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="alpha", quota_bytes=1 << 30, allowed_uids=[1000]))
    admin.create_tenant(TenantSpec(name="beta", quota_bytes=1 << 30, allowed_uids=[1001]))
    with PooldClient(api.url, credential) as client:
        client.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid=CXL,
                        kind="devdax",
                        media="ddr5",
                        capacity_bytes=512 * MiB,
                        local_name="dax_region0",
                        reserved_extents=[(0, 64 * MiB)],
                    ),
                    InventoryDevice(
                        uid=NODE, kind="numa", capacity_bytes=256 * MiB, local_name="node3"
                    ),
                ]
            )
        )
        yield client


def grant(agent: PooldClient, mib: int, uid: int, media: str | None = "ddr5") -> str:
    req = GrantRequest(size_bytes=mib * MiB, uid=uid, pid=7, activate=True, media=media)
    return agent.grant(req).id


def test_json_extents_are_the_leases_and_reserved_ranges(
    api: ThreadedServer, agent: PooldClient, admin: PooldClient
) -> None:
    ids = [grant(agent, 32, 1000), grant(agent, 64, 1001), grant(agent, 16, 1000)]
    agent.release(ids[1])  # a hole between alpha's two leases
    r = poolctl(api, "devices", "map", "dax_region0", "--json")
    assert r.exit_code == 0, r.output
    (dev,) = json.loads(r.stdout)
    assert dev["uid"] == CXL and dev["capacity_bytes"] == 512 * MiB
    extents = dev["extents"]
    cursor = 0
    for e in extents:  # a partition of the device
        assert e["offset_bytes"] == cursor and e["length_bytes"] > 0
        cursor += e["length_bytes"]
    assert cursor == 512 * MiB
    leases = {x.id: x for x in admin.list_leases(live=True) if x.device_uid == CXL}
    leased = [e for e in extents if e["kind"] == "leased"]
    assert {e["lease_id"] for e in leased} == set(leases) == {ids[0], ids[2]}
    for e in leased:
        x = leases[e["lease_id"]]
        assert (e["offset_bytes"], e["length_bytes"], e["tenant"], e["state"]) == (
            x.offset_bytes,
            x.length_bytes,
            x.tenant,
            x.state,
        )
    assert [(e["offset_bytes"], e["length_bytes"]) for e in extents if e["kind"] == "reserved"] == [
        (0, 64 * MiB)
    ]
    status = admin.show_device(CXL)
    assert dev["free_bytes"] == status.free_bytes
    free = [e["length_bytes"] for e in extents if e["kind"] == "free"]
    assert len(free) == dev["free_extents"] == 2
    assert dev["largest_free_extent_bytes"] == max(free)
    assert dev["largest_free_ratio"] == pytest.approx(max(free) / sum(free))
    assert dev["largest_free_bytes"] == status.largest_free_bytes


def test_all_devices_and_the_same_json_from_format(api: ThreadedServer, agent: PooldClient) -> None:
    grant(agent, 8, 1000, media=None)
    r = poolctl(api, "devices", "map", "--json")
    assert r.exit_code == 0, r.output
    assert {d["uid"] for d in json.loads(r.stdout)} == {CXL, NODE}
    assert json.loads(poolctl(api, "--format", "json", "devices", "map").stdout) == json.loads(
        r.stdout
    )


def test_plain_strip_legend_and_figures(api: ThreadedServer, agent: PooldClient) -> None:
    grant(agent, 64, 1000)
    grant(agent, 128, 1001)
    r = poolctl(api, "devices", "map", CXL, "--width", "32")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith(f"{CXL} (id ") and "32 cells of ~16.0 MiB" in lines[0]
    strip = lines[1]
    assert len(strip) == 34 and strip[0] == strip[-1] == "|"
    cells = strip[1:-1]
    # 64 MiB reserved, then alpha's 64 MiB, beta's 128 MiB, 256 MiB free: 16 MiB a cell
    assert cells == "#" * 4 + "A" * 4 + "B" * 8 + "." * 16
    assert "leased 192.0 MiB in 2 lease(s), reserved 64.0 MiB, free 256.0 MiB in 1" in lines[2]
    assert "largest free extent 256.0 MiB (100% of free)" in lines[2]
    legend = lines[-1]
    assert legend.startswith("legend: A alpha (64.0 MiB)  B beta (128.0 MiB)  # reserved")


def test_table_mode_draws_blocks(api: ThreadedServer, agent: PooldClient) -> None:
    grant(agent, 64, 1000)
    r = poolctl(api, "--format", "table", "devices", "map", CXL, "--width", "32")
    assert r.exit_code == 0, r.output
    strip = r.output.splitlines()[1]
    assert strip == "|" + "▓" * 4 + "█" * 4 + "·" * 24 + "|"


def test_an_unknown_device(api: ThreadedServer, agent: PooldClient) -> None:
    r = poolctl(api, "devices", "map", "nope")
    assert r.exit_code == 1 and r.stderr.startswith("poolctl: error[unknown_device]: ")


def quarantine(agent: PooldClient, mib: int) -> str:
    """A devdax lease whose scrub failed: its range is quarantined for good."""
    lease_id = grant(agent, mib, 1000)
    for op in ("release_dirty", "scrub_failed"):
        [res] = agent.apply_ops([LeaseOp(lease_id=lease_id, op=op, reason="poisoned")])  # type: ignore[arg-type]
        assert res.code is None, res
    return lease_id


def test_quarantined_ranges_are_drawn(api: ThreadedServer, agent: PooldClient) -> None:
    quarantine(agent, 64)  # [64 MiB, 128 MiB), after the reserved 64 MiB
    grant(agent, 32, 1001)  # beta, placed after the quarantined range
    r = poolctl(api, "devices", "map", CXL, "--width", "32")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[1] == "|" + "#" * 4 + "X" * 4 + "A" * 2 + "." * 22 + "|"
    assert "reserved 64.0 MiB, quarantined 64.0 MiB, free 352.0 MiB" in lines[2]
    assert "# reserved  X quarantined  . free" in lines[-1]
    r = poolctl(api, "devices", "map", CXL, "--json")
    (dev,) = json.loads(r.stdout)
    held = [(e["offset_bytes"], e["length_bytes"]) for e in dev["extents"]]
    kinds = [e["kind"] for e in dev["extents"]]
    assert list(zip(kinds, held, strict=True))[:3] == [
        ("reserved", (0, 64 * MiB)),
        ("quarantined", (64 * MiB, 64 * MiB)),
        ("leased", (128 * MiB, 32 * MiB)),
    ]
    assert dev["quarantined_bytes"] == 64 * MiB
    r = poolctl(api, "--format", "table", "devices", "map", CXL, "--width", "32")
    assert r.output.splitlines()[1] == "|" + "▓" * 4 + "X" * 4 + "█" * 2 + "·" * 22 + "|"
    r = poolctl(api, "devices", "show", CXL)
    assert "quarantined: 64.0 MiB: [64.0 MiB, 128.0 MiB)" in r.output
