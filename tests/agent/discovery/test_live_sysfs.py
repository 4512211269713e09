"""Each reader against this machine's /sys, where it has the subsystem (skipped otherwise).

Nothing here knows what hardware the machine has; it checks that what the kernel shows
reads cleanly and hangs together."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.discovery.cxl import read_cxl
from agent.discovery.dax import read_dax
from agent.discovery.inventory import discover, to_wire
from agent.discovery.numa import read_numa
from agent.discovery.sysfs import SysfsReader
from agent.discovery.tiers import read_tiers

SYS = Path("/sys")


def needs(path: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not (SYS / path).is_dir(), reason=f"no /sys/{path} here")


@needs("bus/cxl")
class TestLiveCxl:
    def test_memdevs_and_regions(self) -> None:
        r = SysfsReader(SYS)
        cxl = read_cxl(r)
        assert cxl.present
        names = {m.memdev for m in cxl.memdevs}
        for region in cxl.regions:
            assert {m.memdev for m in region.mappings} <= names


@needs("bus/dax")
class TestLiveDax:
    def test_regions_and_devices(self) -> None:
        r = SysfsReader(SYS)
        dax = read_dax(r)
        assert dax.present
        for region in dax.regions:
            for device in region.devices:
                assert device.region_id == region.id
                assert device.mode in ("devdax", "system-ram", "unbound", "unknown")


@needs("devices/system/node")
class TestLiveNuma:
    def test_nodes(self) -> None:
        r = SysfsReader(SYS)
        numa = read_numa(r)
        assert numa.present
        assert numa.nodes
        assert any(n.has_cpu for n in numa.nodes)
        for node in numa.nodes:
            assert node.distance is not None
            assert len(node.distance) >= len(numa.nodes)
            assert node.distance[node.node] == 10  # local distance, by ACPI SLIT definition
            assert node.mem_total_bytes is not None


@needs("devices/virtual/memory_tiering")
class TestLiveTiers:
    def test_every_memory_node_has_a_tier(self) -> None:
        r = SysfsReader(SYS)
        tiers = read_tiers(r)
        numa = read_numa(r)
        for node in numa.nodes:
            if node.has_memory:
                assert tiers.tier_of(node.node) is not None


@needs("devices/system/node")
class TestLiveInventory:
    def test_discover_and_wire(self) -> None:
        inv = discover(SYS)
        for device in to_wire(inv, "live"):
            assert device.capacity_bytes > 0
