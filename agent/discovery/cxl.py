"""What CXL memory devices and regions does this host have?

Reads ``/sys/bus/cxl/devices``: memdevs (``memN``), endpoint decoders (``decoderX.Y`` under
``endpointX``) and regions (``regionN``). Endpoint decoders are read only to tie a region's
``targetN`` to the memdev behind it. Field names follow ``cxl list`` where they overlap.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

from agent.discovery.sysfs import SysfsReader, natural_key, numbered


class Memdev(BaseModel):
    """One CXL memory device (a Type-3 expander) as ``cxl list -M`` shows it."""

    memdev: str
    serial: int | None = None
    ram_size: int | None = None
    pmem_size: int | None = None
    # -1 in sysfs ("no affinity") reads as None, as cxl list omits it.
    numa_node: int | None = None
    firmware_version: str | None = None
    # ram/qos_class, pmem/qos_class: Linux 6.8+, and hidden when the class is invalid.
    ram_qos_class: int | None = None
    pmem_qos_class: int | None = None
    host: str | None = None  # parent PCI function, e.g. "0000:0d:00.0"
    pci_vendor: int | None = None
    pci_device: int | None = None
    endpoint: str | None = None


class RegionTarget(BaseModel):
    """One interleave position of a region: which endpoint decoder, which memdev."""

    position: int
    decoder: str
    memdev: str | None = None
    serial: int | None = None
    dpa_resource: int | None = None
    dpa_size: int | None = None


class AccessCoordinates(BaseModel):
    """Performance the kernel computed for a region (``regionN/accessY``, Linux 6.9+)."""

    read_latency_ns: int | None = None
    write_latency_ns: int | None = None
    read_bandwidth_mbps: int | None = None
    write_bandwidth_mbps: int | None = None


class Region(BaseModel):
    """One CXL region: HPA range interleaved over memdevs, as ``cxl list -R`` shows it."""

    region: str
    uuid: str | None = None  # pmem only; ram regions read back an empty uuid
    type: str | None = None  # "ram" | "pmem"  (sysfs "mode")
    size: int | None = None
    resource: int | None = None
    interleave_ways: int | None = None
    interleave_granularity: int | None = None
    decode_state: str | None = None  # "commit" | "reset"
    root_decoder: str | None = None
    mappings: list[RegionTarget] = Field(default_factory=list)
    dax_region: str | None = None  # "dax_regionN" for ram regions bound to cxl_dax_region
    access0: AccessCoordinates | None = None
    access1: AccessCoordinates | None = None

    def contains(self, address: int) -> bool:
        """Does this region's host-physical range hold ``address``?"""
        if self.resource is None or not self.size:
            return False
        return self.resource <= address < self.resource + self.size


class CxlInventory(BaseModel):
    """Everything CXL the kernel exposes that pooling needs."""

    present: bool = False  # /sys/bus/cxl exists (cxl_core loaded)
    memdevs: list[Memdev] = Field(default_factory=list)
    regions: list[Region] = Field(default_factory=list)

    def memdev(self, name: str) -> Memdev | None:
        """Memdev by kernel name."""
        return next((m for m in self.memdevs if m.memdev == name), None)


def _none_if_negative(value: int | None) -> int | None:
    return None if value is None or value < 0 else value


def read_memdev(r: SysfsReader, name: str, path: Path) -> Memdev:
    """Read one ``memN`` directory."""
    parent = path.parent
    return Memdev(
        memdev=name,
        serial=r.read_int(f"{path}/serial"),
        ram_size=r.read_int(f"{path}/ram/size", probe=True),
        pmem_size=r.read_int(f"{path}/pmem/size", probe=True),
        numa_node=_none_if_negative(r.read_int(f"{path}/numa_node", probe=True)),
        firmware_version=r.read_str(f"{path}/firmware_version", probe=True),
        ram_qos_class=_none_if_negative(r.read_int(f"{path}/ram/qos_class", probe=True)),
        pmem_qos_class=_none_if_negative(r.read_int(f"{path}/pmem/qos_class", probe=True)),
        host=parent.name,
        # cxl_test puts memdevs under platform devices with no PCI ids: probe.
        pci_vendor=r.read_int(f"{parent}/vendor", probe=True),
        pci_device=r.read_int(f"{parent}/device", probe=True),
    )


def read_access(r: SysfsReader, path: str) -> AccessCoordinates | None:
    """``accessY/{read,write}_{latency,bandwidth}`` or None when the kernel has none."""
    if not os.path.isdir(path):
        return None
    return AccessCoordinates(
        read_latency_ns=r.read_int(f"{path}/read_latency", probe=True),
        write_latency_ns=r.read_int(f"{path}/write_latency", probe=True),
        read_bandwidth_mbps=r.read_int(f"{path}/read_bandwidth", probe=True),
        write_bandwidth_mbps=r.read_int(f"{path}/write_bandwidth", probe=True),
    )


def read_region(r: SysfsReader, name: str, path: Path, bus: Path) -> Region:
    """Read one ``regionN`` directory, following ``targetN`` to endpoint decoders."""
    entries = r.listdir(path)
    uuid = r.read_str(f"{path}/uuid", probe=True) or None
    commit = r.read_bool(f"{path}/commit", probe=True)
    mode = r.read_str(f"{path}/mode", probe=True)
    ways = r.read_int(f"{path}/interleave_ways")
    mappings: list[RegionTarget] = []
    for target in numbered(entries, "target"):
        decoder = r.read_str(f"{path}/{target}", probe=True)
        if not decoder:  # an unset slot in a region still being assembled
            continue
        position = int(target.removeprefix("target"))
        mapping = RegionTarget(position=position, decoder=decoder)
        # Resolved on demand: a host has ~4 decoders per port and only targets matter.
        decoder_path = r.resolve(bus / decoder)
        if decoder_path is not None:
            endpoint = decoder_path.parent
            mapping.memdev = r.link_name(f"{endpoint}/uport")
            mapping.dpa_resource = r.read_int(f"{decoder_path}/dpa_resource", probe=True)
            mapping.dpa_size = r.read_int(f"{decoder_path}/dpa_size", probe=True)
            if mode is None:
                mode = r.read_str(f"{decoder_path}/mode", probe=True)
        mappings.append(mapping)
    dax_regions = numbered(entries, "dax_region")
    return Region(
        region=name,
        uuid=None if uuid is None or uuid.strip("0-") == "" else uuid,
        type=mode,
        size=r.read_int(f"{path}/size"),
        resource=r.read_int(f"{path}/resource"),
        interleave_ways=ways,
        interleave_granularity=r.read_int(f"{path}/interleave_granularity"),
        decode_state=None if commit is None else ("commit" if commit else "reset"),
        root_decoder=path.parent.name,
        mappings=mappings,
        dax_region=dax_regions[0] if dax_regions else None,
        access0=read_access(r, f"{path}/access0"),
        access1=read_access(r, f"{path}/access1"),
    )


def read_cxl(r: SysfsReader) -> CxlInventory:
    """Walk ``/sys/bus/cxl/devices``; an absent bus is an empty inventory, not an error."""
    bus = r.path("bus", "cxl", "devices")
    if not bus.is_dir():
        return CxlInventory(present=False)
    names = r.listdir(bus)
    resolved: dict[str, Path] = {}
    for name in names:
        if name.startswith(("mem", "region", "endpoint")):
            real = r.resolve(bus / name)
            if real is not None:
                resolved[name] = real

    memdevs: list[Memdev] = []
    for name in numbered(resolved, "mem"):
        memdevs.append(read_memdev(r, name, resolved[name]))
    by_memdev = {m.memdev: m for m in memdevs}
    for name in numbered(resolved, "endpoint"):
        uport = r.link_name(resolved[name] / "uport")
        if uport in by_memdev:
            by_memdev[uport].endpoint = name

    regions: list[Region] = []
    for name in numbered(resolved, "region"):
        region = read_region(r, name, resolved[name], bus)
        for mapping in region.mappings:
            memdev = by_memdev.get(mapping.memdev or "")
            mapping.serial = memdev.serial if memdev else None
        regions.append(region)
    regions.sort(key=lambda reg: natural_key(reg.region))
    return CxlInventory(present=True, memdevs=memdevs, regions=regions)
