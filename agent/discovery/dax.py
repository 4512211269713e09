"""What device-DAX regions and devices does this host have, and in what mode is each?

Reads ``/sys/bus/dax/devices``. A device's mode comes from its bound driver, as daxctl
derives it: ``device_dax`` is "devdax" (a /dev/daxX.Y char device), ``kmem`` is
"system-ram" (onlined into a NUMA node), no driver is "unbound". Field names follow
``daxctl list -RDM``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, computed_field

from agent.discovery.sysfs import SysfsReader, natural_key, numbered

DaxMode = Literal["devdax", "system-ram", "unbound", "unknown"]

_MODE_BY_DRIVER: dict[str, DaxMode] = {"device_dax": "devdax", "kmem": "system-ram"}


class DaxMapping(BaseModel):
    """One physical range backing a dax device (``mappingN``, Linux 5.10+)."""

    page_offset: int
    start: int
    end: int  # inclusive, as the kernel and daxctl print it

    @computed_field  # type: ignore[prop-decorator]
    @property
    def size(self) -> int:
        """Bytes in the range."""
        return self.end - self.start + 1


class DaxDevice(BaseModel):
    """One dax device (``daxX.Y``)."""

    chardev: str
    region_id: int | None = None
    size: int | None = None
    align: int | None = None
    target_node: int | None = None
    resource: int | None = None
    mode: DaxMode = "unknown"
    driver: str | None = None
    mappings: list[DaxMapping] = Field(default_factory=list)
    # system-ram only, computed from /sys/devices/system/memory like daxctl does.
    online_memblocks: int | None = None
    total_memblocks: int | None = None
    movable: bool | None = None


class DaxRegion(BaseModel):
    """One dax region: the carve-able pool that dax devices are cut from."""

    id: int
    name: str  # the region's device name: "dax_region0" (CXL), "dax2.0" (nd pmem), "hmem0"
    path: str  # under /sys/devices, as daxctl prints it
    size: int | None = None
    resource: int | None = None  # nd (pmem) dax regions only
    align: int | None = None
    available_size: int | None = None
    seed: str | None = None  # next dax device to configure; empty when there is none
    cxl_region: str | None = None  # parent CXL region, when the path says so
    # Host-physical address that region offsets count from, as the devdax backend
    # addresses the region (agent/backends/devdax.py: DevdaxBackend.region).
    base: int | None = None
    # Dynamic (has ``create``, Linux 5.10+): sub-devices can be carved from it. A static
    # region (nd pmem namespace, hmem) is one fixed device, leased whole.
    carvable: bool = False
    devices: list[DaxDevice] = Field(default_factory=list)


class DaxInventory(BaseModel):
    """All dax regions with their devices."""

    present: bool = False  # /sys/bus/dax exists
    regions: list[DaxRegion] = Field(default_factory=list)

    def devices(self) -> list[DaxDevice]:
        """Every dax device, region by region."""
        return [d for reg in self.regions for d in reg.devices]


def _memblock_state(
    r: SysfsReader, device: DaxDevice, block_size: int | None
) -> tuple[int | None, int | None, bool | None]:
    """(online, total, movable) memory blocks of a system-ram device, as daxctl reports."""
    if block_size is None or block_size <= 0 or not device.mappings:
        return None, None, None
    memory = r.path("devices", "system", "memory")
    online = total = 0
    movable = True
    for mapping in device.mappings:
        for index in range(mapping.start // block_size, mapping.end // block_size + 1):
            block = f"{memory}/memory{index}"
            total += 1
            state = r.read_str(f"{block}/state", probe=True)
            if state == "online":
                online += 1
                # An online block lists only the zone it lives in.
                zone = r.read_str(f"{block}/valid_zones", probe=True) or ""
                movable = movable and zone.split(" ")[0] == "Movable"
    return online, total, movable if online else None


def read_dax_device(r: SysfsReader, path: Path) -> DaxDevice:
    """Read one ``daxX.Y`` directory."""
    driver = r.link_name(f"{path}/driver")
    mode: DaxMode = _MODE_BY_DRIVER.get(driver, "unknown") if driver else "unbound"
    mappings: list[DaxMapping] = []
    for name in numbered(r.listdir(path), "mapping"):
        start = r.read_int(f"{path}/{name}/start")
        end = r.read_int(f"{path}/{name}/end")
        offset = r.read_int(f"{path}/{name}/page_offset")
        if start is not None and end is not None and offset is not None:
            mappings.append(DaxMapping(page_offset=offset, start=start, end=end))
    target = r.read_int(f"{path}/target_node", probe=True)
    return DaxDevice(
        chardev=path.name,
        size=r.read_int(f"{path}/size"),
        align=r.read_int(f"{path}/align", probe=True),  # Linux 5.10+
        target_node=None if target is None or target < 0 else target,
        resource=r.read_int(f"{path}/resource", probe=True),
        mode=mode,
        driver=driver,
        mappings=mappings,
    )


def read_dax_region(r: SysfsReader, path: Path) -> DaxRegion | None:
    """Read the ``dax_region/`` attribute group of a region device directory."""
    attrs = f"{path}/dax_region"
    region_id = r.read_int(f"{attrs}/id")
    if region_id is None:
        return None
    try:
        rel = "/" + str(path.relative_to(r.path("devices")))
    except ValueError:
        rel = str(path)
    parent = path.parent
    is_cxl = parent.name.startswith("region") and os.path.exists(f"{parent}/interleave_ways")
    cxl_region = parent.name if is_cxl else None
    resource = r.read_int(f"{path}/resource", probe=True)
    # Same rule as the devdax backend: a dax region under a regionN spans it (CXL:
    # drivers/dax/cxl.c hpa_range), so offsets count from regionN/resource; else its own.
    base = (
        r.read_int(f"{parent}/resource", probe=True) if parent.name.startswith("region") else None
    )
    return DaxRegion(
        id=region_id,
        name=path.name,
        path=rel,
        size=r.read_int(f"{attrs}/size"),
        resource=resource,
        align=r.read_int(f"{attrs}/align", probe=True),
        # available_size/seed/create: dynamic dax regions, Linux 5.10+.
        available_size=r.read_int(f"{attrs}/available_size", probe=True),
        seed=r.read_str(f"{attrs}/seed", probe=True) or None,
        cxl_region=cxl_region,
        base=base if base is not None else resource,
        carvable=os.path.exists(f"{attrs}/create"),
    )


def read_dax(r: SysfsReader) -> DaxInventory:
    """Walk ``/sys/bus/dax/devices`` and group devices under their regions.

    Pre-5.1 kernels exposed dax under /sys/class/dax only; they are not supported.
    """
    bus = r.path("bus", "dax", "devices")
    if not bus.is_dir():
        return DaxInventory(present=False)
    regions: dict[Path, DaxRegion] = {}
    block_size = r.read_hex(r.path("devices", "system", "memory", "block_size_bytes"), probe=True)
    for name in numbered(r.listdir(bus), "dax"):
        real = r.resolve(bus / name)
        if real is None:
            continue
        region_path = real.parent
        region = regions.get(region_path)
        if region is None:
            region = read_dax_region(r, region_path)
            if region is None:
                r.warn(f"/sys/bus/dax/devices/{name}: no readable dax region above it")
                continue
            regions[region_path] = region
        device = read_dax_device(r, real)
        device.region_id = region.id
        if device.mode == "system-ram":
            online, total, movable = _memblock_state(r, device, block_size)
            device.online_memblocks, device.total_memblocks, device.movable = online, total, movable
        region.devices.append(device)
    ordered = sorted(regions.values(), key=lambda reg: reg.id)
    for region in ordered:
        region.devices.sort(key=lambda d: natural_key(d.chardev))
    return DaxInventory(present=True, regions=ordered)
