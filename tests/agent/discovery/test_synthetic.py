"""Discovery at scale on a generated tree shaped like the kernel's."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.discovery.inventory import discover
from tests.fixtures.synthetic import write_synthetic_sysfs


def test_generated_tree_is_discovered_exactly(tmp_path: Path) -> None:
    tree = write_synthetic_sysfs(tmp_path, memdevs=16, regions=8, dax_devices=16)
    inv = discover(tree.sys_root)
    assert inv.warnings == []
    assert sorted(m.serial for m in inv.cxl.memdevs if m.serial is not None) == tree.serials
    assert len(inv.cxl.regions) == tree.regions
    assert len(inv.dax.devices()) == tree.dax_devices
    assert len(inv.numa.nodes) == tree.nodes
    devdax = [d for d in inv.devices if d.kind == "devdax"]
    numa = [d for d in inv.devices if d.kind == "numa"]
    dax_ids = sorted(d.dax_region_id for d in devdax if d.dax_region_id is not None)
    assert dax_ids == tree.devdax_regions
    assert sorted(d.numa_node for d in numa if d.numa_node is not None) == tree.far_nodes
    assert sum(len(d.cxl_regions) for d in numa) == len(tree.kmem_regions)
    assert len({d.uid for d in inv.devices}) == len(inv.devices)
    for device in inv.dax.devices():
        if device.mode == "system-ram":
            assert device.online_memblocks == device.total_memblocks
            assert device.movable


def test_generator_rejects_uneven_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiples"):
        write_synthetic_sysfs(tmp_path, memdevs=5, regions=2, dax_devices=2)
