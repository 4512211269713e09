"""`poolctl devices show` shows the ranges dax devices poold did not place hold (both ledgers)."""

from __future__ import annotations

import json

from poold.api.client import PooldClient
from poold.wire.agent import Heartbeat, InventoryDevice
from tests.cli.test_devices import poolctl
from tests.conftest import ThreadedServer

MiB = 1 << 20
UID = "cxl:ram:serials=1:ways=1:gran=4096:size=268435456"


def seed(api: ThreadedServer, admin: PooldClient, reserved: list[tuple[int, int]]) -> None:
    credential = admin.add_host("h1").credential
    with PooldClient(api.url, credential) as agent:
        agent.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(
                        uid=UID,
                        kind="devdax",
                        media="ddr5",
                        capacity_bytes=256 * MiB,
                        local_name="dax_region0",
                        reserved_extents=reserved,
                    )
                ]
            )
        )


def test_show_lists_reserved_ranges_and_bytes(api: ThreadedServer, admin: PooldClient) -> None:
    seed(api, admin, [(0, 128 * MiB), (128 * MiB, 64 * MiB)])
    r = poolctl(api, "devices", "show", "dax_region0")
    assert r.exit_code == 0, r.output
    lines = {
        k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in r.output.splitlines())
    }
    assert lines["reserved"] == "192.0 MiB: [0 B, 128.0 MiB), [128.0 MiB, 192.0 MiB)"
    assert lines["free"] == "64.0 MiB" and lines["capacity"] == "256.0 MiB"
    r = poolctl(api, "devices", "show", UID, "--json")
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)
    assert row["reserved_extents"] == [[0, 128 * MiB], [128 * MiB, 64 * MiB]]
    assert row["reserved_bytes"] == 192 * MiB and row["free_bytes"] == 64 * MiB
    r = poolctl(api, "devices")  # the table's free column leaves reserved bytes out
    assert r.exit_code == 0 and "64.0 MiB" in r.output


def test_show_without_reserved_ranges(api: ThreadedServer, admin: PooldClient) -> None:
    seed(api, admin, [])
    r = poolctl(api, "devices", "show", "dax_region0")
    assert r.exit_code == 0, r.output
    assert any(
        ln.split(":", 1)[0].strip() == "reserved" and ln.split(":", 1)[1].strip() == "-"
        for ln in r.output.splitlines()
    )
