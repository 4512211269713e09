"""`GET`/`PATCH /v1/devices/{uid}` over real HTTP: uids with slashes, admin only, stable codes."""

from __future__ import annotations

import httpx
import pytest

from poold.api.client import PooldClient
from poold.errors import Forbidden, UnknownDevice
from poold.wire.admin import DeviceAnnotate
from poold.wire.agent import Heartbeat, InventoryDevice
from tests.conftest import ADMIN_TOKEN, ThreadedServer

HOST_SCOPED = "h1/numa:node2"
CXL = "cxl:ram:serials=3,4:ways=2:gran=4096:size=536870912"


def register(api: ThreadedServer, admin: PooldClient) -> str:
    credential = admin.add_host("h1").credential
    with PooldClient(api.url, credential) as agent:
        agent.register(
            Heartbeat(
                inventory=[
                    InventoryDevice(uid=HOST_SCOPED, kind="numa", capacity_bytes=1 << 30),
                    InventoryDevice(
                        uid=CXL,
                        kind="devdax",
                        media="ddr5",
                        capacity_bytes=1 << 29,
                        memdev_serials=[3, 4],
                        memory_tier=22,
                    ),
                ]
            )
        )
    return credential


@pytest.mark.parametrize("uid", [HOST_SCOPED, CXL])
def test_annotate_and_show(api: ThreadedServer, admin: PooldClient, uid: str) -> None:
    register(api, admin)
    out = admin.annotate_device(
        uid, DeviceAnnotate(media="ddr4", recycled=True, cost_per_gib_month=0.25)
    )
    assert out.uid == uid and out.media == "ddr4" and out.recycled
    assert out.cost_per_gib_month == pytest.approx(0.25)
    assert admin.show_device(uid).admin_annotations.media == "ddr4"
    status = {d.uid: d for d in admin.status().devices}
    assert status[uid].media == "ddr4"


def test_refusals(api: ThreadedServer, admin: PooldClient) -> None:
    credential = register(api, admin)
    with pytest.raises(UnknownDevice):
        admin.annotate_device("no/such:device", DeviceAnnotate(media="ddr4"))
    with PooldClient(api.url, credential) as agent, pytest.raises(Forbidden):
        agent.annotate_device(CXL, DeviceAnnotate(media="ddr4"))
    # Bad bodies are 400 with a code, and change nothing.
    with httpx.Client(base_url=api.url) as http:
        for body in ({"media": "DDR 4"}, {"cost_per_gib_month": -1}, {"colour": "red"}):
            resp = http.patch(
                f"/v1/devices/{CXL}",
                json=body,
                headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            )
            assert resp.status_code == 400 and resp.json()["code"] == "bad_request", body
    assert admin.show_device(CXL).media == "ddr5"
