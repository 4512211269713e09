"""Pool-device modelling (pure): identity survives renumbering, health and wire mapping."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agent.discovery.cxl import CxlInventory
from agent.discovery.dax import DaxInventory
from agent.discovery.health import HealthReport, MemdevHealth
from agent.discovery.inventory import discover, to_wire
from agent.discovery.model import build_pool_devices, region_identities
from agent.discovery.numa import NumaInventory
from agent.discovery.tiers import TierInventory

MACHINE = "qemu-full-06-interleave"


def renumbered(cxl: CxlInventory, dax: DaxInventory) -> tuple[CxlInventory, DaxInventory]:
    """The same hardware after a reboot that probed in another order."""
    names = {m.memdev: f"mem{9 - i}" for i, m in enumerate(cxl.memdevs)}
    cxl = cxl.model_copy(deep=True)
    for m in cxl.memdevs:
        m.memdev = names[m.memdev]
    for i, region in enumerate(reversed(cxl.regions)):
        region.region = f"region{7 + i}"
        region.mappings.reverse()
        for pos, mapping in enumerate(region.mappings):
            mapping.memdev = names.get(mapping.memdev or "")
            mapping.position = pos
    dax = dax.model_copy(deep=True)
    for dax_region in dax.regions:
        dax_region.cxl_region = None  # tie by address instead of by name
        for device in dax_region.devices:
            device.chardev = "dax" + device.chardev[3:].replace(".0", ".5")
    return cxl, dax


def test_identity_survives_renumbering(machine_root: Callable[[str], Path]) -> None:
    inv = discover(machine_root(MACHINE))
    cxl, dax = renumbered(inv.cxl, inv.dax)
    again = build_pool_devices(cxl, dax, inv.numa, inv.tiers)
    assert sorted(d.uid for d in again) == sorted(d.uid for d in inv.devices)


def test_identical_geometry_on_same_memdevs_is_told_apart(
    machine_root: Callable[[str], Path],
) -> None:
    inv = discover(machine_root(MACHINE))
    first = inv.cxl.regions[1].model_copy(deep=True)
    second = first.model_copy(deep=True)
    second.region = "region9"
    for m in second.mappings:
        m.dpa_resource = 1 << 28
    idents = region_identities([first, second])
    assert idents["region1"][0] != idents["region9"][0]
    assert idents["region9"][0].endswith(":dpa=0x10000000")


def test_health_is_the_worst_memdev(machine_root: Callable[[str], Path]) -> None:
    inv = discover(machine_root(MACHINE))
    report = HealthReport(
        tool="available",
        memdevs=[
            MemdevHealth(memdev="mem0", serial=3, state="ok"),
            MemdevHealth(memdev="mem1", serial=4, state="warning", reasons=["1 media errors"]),
            MemdevHealth(memdev="mem3", serial=1, state="ok"),
        ],
    )
    devices = build_pool_devices(inv.cxl, inv.dax, inv.numa, inv.tiers, report)
    by_name = {d.local_name: d for d in devices}
    assert by_name["node2"].health == "warning"
    assert by_name["node2"].health_reasons == ["serial 4: 1 media errors"]
    assert by_name["node1"].health == "ok"
    assert by_name["dax_region2"].health == "unknown"  # serial 2 not reported


def test_cpu_less_node_without_cxl_is_host_scoped() -> None:
    numa = NumaInventory.model_validate(
        {
            "present": True,
            "nodes": [
                {
                    "node": 0,
                    "online": True,
                    "has_cpu": True,
                    "has_memory": True,
                    "distance": [10, 31],
                    "mem_total_bytes": 1 << 34,
                },
                {
                    "node": 1,
                    "online": True,
                    "has_cpu": False,
                    "has_memory": True,
                    "distance": [31, 10],
                    "mem_total_bytes": 1 << 36,
                    "access1": {
                        "initiators": [0],
                        "read_latency_ns": 250,
                        "read_bandwidth_mbps": 30000,
                    },
                },
            ],
        }
    )
    tiers = TierInventory.model_validate(
        {"present": True, "tiers": [{"tier": 4, "nodes": [0]}, {"tier": 22, "nodes": [1]}]}
    )
    devices = build_pool_devices(CxlInventory(), DaxInventory(), numa, tiers)
    assert len(devices) == 1
    dev = devices[0]
    assert (dev.kind, dev.uid, dev.host_scoped) == ("numa", "numa:node1", True)
    assert (dev.distance, dev.memory_tier, dev.read_latency_ns) == (31, 22, 250)
    from agent.discovery.inventory import Inventory

    inv = Inventory(
        sysfs_root="/sys",
        cxl=CxlInventory(),
        dax=DaxInventory(),
        numa=numa,
        tiers=tiers,
        health=HealthReport(),
        devices=devices,
    )
    wire = to_wire(inv, "rack1-h07")
    assert wire[0].uid == "rack1-h07/numa:node1"
    assert wire[0].read_bandwidth_mbps == 30000
    assert wire[0].distance == 31
