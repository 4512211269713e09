"""Reserved extents: the bytes of a dax region held by dax devices the agent did not make.

Against every recorded machine, expected ranges come from the captured ``daxctl list`` and
``cxl list`` (mapping start less the CXL region's resource), never retyped. The fallbacks
for a device that cannot be located are checked on hand-built regions (pure model).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.discovery.dax import DaxDevice, DaxMapping, DaxRegion
from agent.discovery.inventory import discover, to_wire
from agent.discovery.model import region_occupants
from tests.agent.discovery.test_recorded_machines import cxl_regions
from tests.fixtures.machines.loader import Machine, machine_names

MIB = 1 << 20
MACHINES = machine_names("qemu-")


def expected_reserved(machine: Machine) -> dict[str, list[tuple[int, int]]]:
    """local name -> ranges every dax device with bytes holds, for CXL dax regions.

    A CXL dax region spans its CXL region, so offsets count from the region's resource.
    The other dax regions in these captures are nd pmem namespaces: static, leased whole,
    nothing reserved.
    """
    regions = cxl_regions(machine)
    out: dict[str, list[tuple[int, int]]] = {}
    for dax in machine.daxctl_list():
        name = f"dax_region{dax['id']}"
        parent = dax["path"].split("/")[-2]
        if not dax["path"].endswith(f"/{name}") or parent not in regions:
            out[name] = []
            continue
        base = regions[parent]["resource"]
        out[name] = sorted(
            (m["start"] - base, m["size"])
            for device in dax.get("devices", [])
            for m in device.get("mappings", [])
        )
    return out


@pytest.mark.parametrize("name", MACHINES)
def test_reserved_extents_match_daxctl(name: str, machine_root: Callable[[str], Path]) -> None:
    machine = Machine(name)
    wire = to_wire(discover(machine_root(name)), "h1")
    expected = expected_reserved(machine)
    for device in wire:
        if device.kind != "devdax":
            assert device.reserved_extents == []
            continue
        assert device.reserved_extents == expected[device.local_name], device.local_name


def test_kernel_dax0_0_claiming_the_region_is_reported(
    machine_root: Callable[[str], Path],
) -> None:
    """Issue #4: the kernel's dax0.0 holds the whole region at boot."""
    machine = Machine("qemu-single-02-devdax")
    (region,) = machine.daxctl_list()
    (dax0,) = region["devices"]
    assert dax0["chardev"] == "dax0.0" and dax0["size"] == region["size"]
    (device,) = [d for d in to_wire(discover(machine_root(machine.name)), "h1")]
    assert device.kind == "devdax" and device.capacity_bytes == region["size"]
    assert device.reserved_extents == [(0, region["size"])]


def test_partitioned_region_reports_each_device(machine_root: Callable[[str], Path]) -> None:
    """dax0.0 (128 MiB at 0) and dax0.1 (64 MiB after it); the last 64 MiB is free."""
    (device,) = to_wire(discover(machine_root("qemu-single-03-partitioned")), "h1")
    assert device.reserved_extents == [(0, 128 * MIB), (128 * MIB, 64 * MIB)]


def test_own_sub_devices_are_not_reserved(machine_root: Callable[[str], Path]) -> None:
    inv = discover(machine_root("qemu-single-03-partitioned"))
    (device,) = to_wire(inv, "h1", own_sub_devices={"dax0.1"})
    assert device.reserved_extents == [(0, 128 * MIB)]
    (device,) = to_wire(inv, "h1", own_sub_devices={"dax0.0", "dax0.1"})
    assert device.reserved_extents == []


def test_discovery_reads_base_and_carvability(machine_root: Callable[[str], Path]) -> None:
    machine = Machine("qemu-full-05-pmem")
    inv = discover(machine_root(machine.name))
    by_id = {r.id: r for r in inv.dax.regions}
    assert by_id[0].carvable and by_id[0].base == cxl_regions(machine)["region0"]["resource"]
    assert not by_id[2].carvable  # an nd pmem namespace: static, leased whole
    assert region_occupants(by_id[2]) == []


# --- the model's fallbacks, on hand-built regions -------------------------------------------

BASE = 0x490000000


def region(*devices: DaxDevice, **kw: Any) -> DaxRegion:
    fields: dict[str, Any] = {
        "id": 0,
        "name": "dax_region0",
        "path": "/x/region0/dax_region0",
        "size": 256 * MIB,
        "base": BASE,
        "carvable": True,
        "devices": list(devices),
    }
    fields.update(kw)
    return DaxRegion(**fields)


def dax(name: str, size: int, *ranges: tuple[int, int], **kw: Any) -> DaxDevice:
    mappings = [
        DaxMapping(page_offset=0, start=BASE + offset, end=BASE + offset + length - 1)
        for offset, length in ranges
    ]
    return DaxDevice(chardev=name, size=size, mode="devdax", mappings=mappings, **kw)


def extents_of(reg: DaxRegion) -> dict[str, list[tuple[int, int]]]:
    return {o.device: o.extents for o in region_occupants(reg)}


def test_multi_range_device_and_seed() -> None:
    reg = region(
        dax("dax0.0", 12 * MIB, (64 * MIB, 8 * MIB), (0, 4 * MIB)),
        dax("dax0.1", 0),  # the seed: no bytes
    )
    assert extents_of(reg) == {"dax0.0": [(0, 4 * MIB), (64 * MIB, 8 * MIB)]}


def test_device_without_mappings_falls_back_to_resource_then_whole_region() -> None:
    located = dax("dax0.0", 8 * MIB, resource=BASE + 32 * MIB)
    unknown = dax("dax0.1", 8 * MIB)
    assert extents_of(region(located, unknown)) == {
        "dax0.0": [(32 * MIB, 8 * MIB)],
        "dax0.1": [(0, 256 * MIB)],
    }


def test_unlocatable_device_holds_the_whole_region() -> None:
    outside = dax("dax0.0", 8 * MIB, (250 * MIB, 8 * MIB))  # past the region's end
    assert extents_of(region(outside)) == {"dax0.0": [(0, 256 * MIB)]}
    no_base = dax("dax0.0", 8 * MIB, (0, 8 * MIB))
    assert extents_of(region(no_base, base=None)) == {"dax0.0": [(0, 256 * MIB)]}


def test_static_region_reserves_nothing() -> None:
    assert extents_of(region(dax("dax2.0", 256 * MIB, (0, 256 * MIB)), carvable=False)) == {}
