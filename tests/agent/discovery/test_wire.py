"""`to_wire`: every discovery field poold stores travels in InventoryDevice."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.discovery.inventory import discover, to_wire
from tests.agent.discovery.test_health import HEALTHY, NEW_USAGE


def test_tier_serials_and_health_reasons_on_the_wire(
    machine_root: Callable[[str], Path],
) -> None:
    worn = {**HEALTHY, "ext_life_used": "warning", "maintenance_needed": True}
    listing = [
        {"memdev": "mem2", "serial": 3, "health": worn, "media_errors": []},
        {"memdev": "mem3", "serial": 4, "health": HEALTHY, "media_errors": []},
    ]

    def run(argv: Sequence[str]) -> tuple[int, str, str]:
        return (129, "", NEW_USAGE) if "-h" in argv else (0, json.dumps(listing), "")

    inv = discover(machine_root("qemu-full-06-interleave"), run_cxl=run)
    wire = {d.local_name: d for d in to_wire(inv, "h1")}
    node2 = wire["node2"]
    assert node2.memdev_serials == [3, 4]
    assert node2.health == "warning"
    assert node2.health_reasons == [
        "serial 3: maintenance_needed",
        "serial 3: ext_life_used=warning",
    ]
    assert node2.memory_tier is not None
    by_local = {d.local_name: d for d in inv.devices}
    assert node2.memory_tier == by_local["node2"].memory_tier
    # A device whose memdevs cxl-cli did not list is "unknown", with no reasons.
    assert wire["dax_region2"].health == "unknown" and wire["dax_region2"].health_reasons == []
