"""Which pools of far memory can poold carve on this host? (pure: no I/O)

Turns the raw CXL/DAX/NUMA/tier/health readings into pool devices:

* a dax region in device-DAX use (CXL RAM or pmem region, or a standalone one such as
  hmem or an nvdimm namespace) is one ``devdax`` device: leases are dax sub-devices carved
  from it; bytes onlined as system-ram are not part of it;
* a CPU-less NUMA node with memory (typically dax devices onlined by kmem) is one ``numa``
  device: leases are memfds bound to that node.

A carvable dax region lists the dax devices already holding its bytes (``dax_occupants``,
at offsets within the region): the kernel's ``dax0.0``, an administrator's daxctl devices,
the agent's own lease sub-devices. The agent reports the ones it did not make as reserved
extents, which poold never places on.

Identity must survive reboots and renumbering (``mem0``/``dax0.0``/``node2`` are probe
order), so CXL-backed devices are named by memdev serials plus region geometry. Devices
with no CXL behind them get an identity that is only unique per host; the wire layer
prefixes the host name (``host_scoped``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, Field

from agent.discovery.annotations import Annotations, merge_for_device
from agent.discovery.cxl import AccessCoordinates, CxlInventory, Region
from agent.discovery.dax import DaxInventory, DaxRegion
from agent.discovery.health import HealthReport, HealthState, worst
from agent.discovery.numa import Node, NodeAccess, NumaInventory
from agent.discovery.tiers import TierInventory

PoolKind = Literal["devdax", "numa"]
DEFAULT_ALIGN_BYTES = 2 << 20  # device-dax's default (PMD) alignment
# Left out of a numa device's capacity: the node's watermarks, the kernel's allocations
# that come and go there (page-cache xarrays, slab), and the slack between rescans.
DEFAULT_NUMA_RESERVE_BYTES = 64 << 20
# A numa device's capacity moves with the node's free memory: in steps this coarse, so
# that a few pages more or less do not make every rescan a new inventory.
NUMA_CAPACITY_STEP_BYTES = 16 << 20


def numa_capacity_bytes(
    node: Node, reserve_bytes: int = DEFAULT_NUMA_RESERVE_BYTES, fallback_bytes: int = 0
) -> int:
    """What a CPU-less node can really give leases, less ``reserve_bytes`` (pure).

    Not MemTotal: the kernel holds part of every node (its struct pages, unreclaimable
    slab and page tables, whatever fell back there), measured in the QEMU guest at ~50 MiB
    of a 512 MiB node, and a lease poold places on bytes the node cannot give fails in the
    backend. What it can give is what is free, plus what reclaim gives back (file pages,
    reclaimable kernel memory), plus what leases already hold (memfd pages are shmem, and
    the ledger counts them as leased, not as gone): MemTotal less what the kernel keeps.
    Without MemFree (an old or partial meminfo), MemTotal; in whole
    :data:`NUMA_CAPACITY_STEP_BYTES` steps.
    """
    total = node.mem_total_bytes or fallback_bytes
    giveable = total
    if node.mem_free_bytes is not None:
        giveable = min(
            total,
            node.mem_free_bytes
            + (node.file_lru_bytes or 0)
            + (node.kreclaimable_bytes or 0)
            + (node.shmem_bytes or 0),
        )
    usable = max(0, giveable - reserve_bytes)
    return usable - usable % NUMA_CAPACITY_STEP_BYTES


class DaxOccupant(BaseModel):
    """A dax device holding bytes of a carvable dax region."""

    device: str  # "dax0.0"
    mode: str  # devdax, system-ram, unbound, unknown
    extents: list[tuple[int, int]]  # (offset, length) within the region, offset order


class PoolDevice(BaseModel):
    """One pool of far memory poold can lease from, as this host reaches it."""

    uid: str
    host_scoped: bool = False
    kind: PoolKind
    local_name: str  # "dax_region0" (devdax) or "node2" (numa)
    capacity_bytes: int
    alignment_bytes: int = DEFAULT_ALIGN_BYTES
    numa_node: int | None = None
    memory_tier: int | None = None  # kernel memory tier: its latency/bandwidth class
    distance: int | None = None  # SLIT distance from the nearest CPU node
    read_latency_ns: int | None = None
    write_latency_ns: int | None = None
    read_bandwidth_mbps: int | None = None
    write_bandwidth_mbps: int | None = None
    memdev_serials: list[int] = Field(default_factory=list)
    cxl_regions: list[str] = Field(default_factory=list)
    dax_region_id: int | None = None
    dax_devices: list[str] = Field(default_factory=list)
    dax_occupants: list[DaxOccupant] = Field(default_factory=list)
    # A static dax region (a pmem namespace in devdax mode, hmem): no seed/create/delete,
    # so the backend leases its one device whole; poold must place nothing smaller.
    whole_only: bool = False
    media: str = "unknown"
    recycled: bool = False
    provenance: str | None = None
    cost_per_gib_month: float | None = None
    health: HealthState = "unknown"
    health_reasons: list[str] = Field(default_factory=list)


def region_identities(regions: Iterable[Region]) -> dict[str, tuple[str, bool]]:
    """Stable name of every region: ``cxl:<mode>:serials=..:ways=..:gran=..:size=..``.

    Serials are sorted: a volatile region re-created with its targets in another order is
    the same hardware. Two regions of identical geometry on the same memdevs (partitioned
    DPA) are told apart by where they start in device memory. Returns name ->
    (identity, host_scoped).
    """
    out: dict[str, tuple[str, bool]] = {}
    for region in regions:
        serials = [m.serial for m in region.mappings if m.serial is not None]
        mode = region.type or "unknown"
        if serials and len(serials) == len(region.mappings):
            ident = (
                f"cxl:{mode}:serials={','.join(str(s) for s in sorted(serials))}"
                f":ways={region.interleave_ways}:gran={region.interleave_granularity}"
                f":size={region.size}"
            )
            out[region.region] = (ident, False)
        else:  # a serial we couldn't read: fall back to the host-physical range
            res = "unknown" if region.resource is None else hex(region.resource)
            out[region.region] = (f"cxl:{mode}:resource={res}:size={region.size}", True)
    seen: dict[str, list[Region]] = {}
    by_name = {r.region: r for r in regions}
    for name, (ident, _) in out.items():
        seen.setdefault(ident, []).append(by_name[name])
    for ident, clash in seen.items():
        if len(clash) > 1:
            for region in clash:
                dpa = min((m.dpa_resource or 0 for m in region.mappings), default=0)
                out[region.region] = (f"{ident}:dpa={dpa:#x}", out[region.region][1])
    return out


def _cxl_region_of(dax_region: DaxRegion, cxl: CxlInventory) -> Region | None:
    """The CXL region behind a dax region: its sysfs parent, else by physical address
    (an nd pmem dax region sits under the nvdimm bus, not under its CXL region)."""
    if dax_region.cxl_region is not None:
        return next((r for r in cxl.regions if r.region == dax_region.cxl_region), None)
    addresses = [m.start for d in dax_region.devices for m in d.mappings]
    if dax_region.resource is not None:
        addresses.append(dax_region.resource)
    for address in addresses:
        for region in cxl.regions:
            if region.contains(address):
                return region
    return None


def region_occupants(region: DaxRegion) -> list[DaxOccupant]:
    """Every dax device with bytes in a carvable region, at offsets within the region.

    An offset is ``mapping.start - base``: the inverse of the devdax backend, which carves
    a lease at ``base + offset``. A static region yields none: its one device is how the
    backend leases it (whole). A device whose bytes cannot be located (no ``mappingN``
    and no ``resource``, an unknown base, a range outside the region) is taken to hold
    the whole region: placing a lease on bytes that may be in use would fail at carve time.
    """
    if not region.carvable:
        return []
    whole = [(0, region.size)] if region.size else []
    out: list[DaxOccupant] = []
    for dax in region.devices:
        if not dax.size:
            continue  # the seed, or a device shrunk to nothing: holds no bytes
        ranges = [(m.start, m.size) for m in dax.mappings]
        if not ranges and dax.resource is not None:
            ranges = [(dax.resource, dax.size)]  # mappingN unreadable: assume one range
        extents = whole
        if region.base is not None and region.size is not None and ranges:
            offsets = [(start - region.base, length) for start, length in ranges]
            if all(o >= 0 and o + n <= region.size for o, n in offsets):
                extents = sorted(offsets)
        out.append(DaxOccupant(device=dax.chardev, mode=dax.mode, extents=extents))
    return out


def _perf(device: PoolDevice, node: Node | None, region_access: AccessCoordinates | None) -> None:
    """HMAT numbers of the node (CPU initiators first), else the CXL region's CDAT-derived
    numbers (regionN/accessY, Linux 6.9+)."""
    source: NodeAccess | AccessCoordinates | None = None
    if node is not None:
        source = node.access1 or node.access0
    if source is None:
        source = region_access
    if source is None:
        return
    device.read_latency_ns = source.read_latency_ns
    device.write_latency_ns = source.write_latency_ns
    device.read_bandwidth_mbps = source.read_bandwidth_mbps
    device.write_bandwidth_mbps = source.write_bandwidth_mbps


def _distance(numa: NumaInventory, node_id: int | None) -> int | None:
    """Distance from the nearest node that has CPUs."""
    if node_id is None:
        return None
    rows = [
        n.distance[node_id]
        for n in numa.nodes
        if n.has_cpu and n.distance is not None and node_id < len(n.distance)
    ]
    return min(rows) if rows else None


def build_pool_devices(
    cxl: CxlInventory,
    dax: DaxInventory,
    numa: NumaInventory,
    tiers: TierInventory,
    health: HealthReport | None = None,
    annotations: Annotations | None = None,
    numa_reserve_bytes: int = DEFAULT_NUMA_RESERVE_BYTES,
) -> list[PoolDevice]:
    """Every pool device on this host, annotated, in a stable order; a numa device's
    capacity is what its node can give now, less ``numa_reserve_bytes``."""
    idents = region_identities(cxl.regions)
    devices: list[PoolDevice] = []
    # node id -> CXL regions whose dax devices are onlined there
    kmem_regions: dict[int, list[Region]] = {}
    kmem_bytes_by_node: dict[int, int] = {}
    non_cxl_kmem: set[int] = set()

    for dax_region in dax.regions:
        cxl_region = _cxl_region_of(dax_region, cxl)
        system_ram = [d for d in dax_region.devices if d.mode == "system-ram"]
        for d in system_ram:
            if d.target_node is None:
                continue
            kmem_bytes_by_node[d.target_node] = kmem_bytes_by_node.get(d.target_node, 0) + (
                d.size or 0
            )
            if cxl_region is None:
                non_cxl_kmem.add(d.target_node)
            elif cxl_region not in kmem_regions.setdefault(d.target_node, []):
                kmem_regions[d.target_node].append(cxl_region)
        capacity = (dax_region.size or 0) - sum(d.size or 0 for d in system_ram)
        if capacity <= 0:
            continue  # all of it is online as system-ram: it belongs to a numa device
        nodes = [d.target_node for d in dax_region.devices if d.target_node is not None]
        device = PoolDevice(
            uid="",
            kind="devdax",
            local_name=f"dax_region{dax_region.id}",
            capacity_bytes=capacity,
            alignment_bytes=dax_region.align or DEFAULT_ALIGN_BYTES,
            numa_node=nodes[0] if nodes else None,
            dax_region_id=dax_region.id,
            dax_devices=[
                d.chardev for d in dax_region.devices if d.mode != "system-ram" and d.size
            ],
            # system-ram devices too: capacity leaves their bytes out, but offsets count
            # from the region's start, so where they sit must not be carved either.
            dax_occupants=region_occupants(dax_region),
            whole_only=not dax_region.carvable,
        )
        if cxl_region is not None:
            device.uid, device.host_scoped = idents[cxl_region.region]
            device.cxl_regions = [cxl_region.region]
            device.memdev_serials = sorted(
                m.serial for m in cxl_region.mappings if m.serial is not None
            )
        else:
            starts = [m.start for d in dax_region.devices for m in d.mappings]
            start = (
                dax_region.resource
                if dax_region.resource is not None
                else min(starts, default=None)
            )
            where = f"resource={start:#x}" if start is not None else f"region={dax_region.id}"
            device.uid, device.host_scoped = f"dax:{where}:size={dax_region.size}", True
        region_access = None
        if cxl_region is not None:
            region_access = cxl_region.access1 or cxl_region.access0
        node = numa.node(device.numa_node) if device.numa_node is not None else None
        _perf(device, node, region_access)
        devices.append(device)

    for node in numa.nodes:
        if not node.cpu_less or node.online is False:
            continue
        capacity = numa_capacity_bytes(
            node, numa_reserve_bytes, kmem_bytes_by_node.get(node.node, 0)
        )
        if capacity <= 0:
            continue
        backing = kmem_regions.get(node.node, [])
        device = PoolDevice(
            uid="",
            kind="numa",
            local_name=f"node{node.node}",
            capacity_bytes=capacity,
            # memfd + mbind allocate whole pages; 2 MiB keeps leases THP-friendly.
            alignment_bytes=DEFAULT_ALIGN_BYTES,
            numa_node=node.node,
            cxl_regions=[r.region for r in backing],
            memdev_serials=sorted(
                {m.serial for r in backing for m in r.mappings if m.serial is not None}
            ),
        )
        if backing and node.node not in non_cxl_kmem:
            parts = sorted(idents[r.region][0] for r in backing)
            device.uid = "numa:" + "+".join(parts)
            device.host_scoped = any(idents[r.region][1] for r in backing)
        else:
            # Memory the firmware onlined or a non-CXL dax: only the node id names it.
            device.uid, device.host_scoped = f"numa:node{node.node}", True
        region_access = None
        if len(backing) == 1:
            region_access = backing[0].access1 or backing[0].access0
        _perf(device, node, region_access)
        devices.append(device)

    for device in devices:
        device.memory_tier = (
            tiers.tier_of(device.numa_node) if device.numa_node is not None else None
        )
        device.distance = _distance(numa, device.numa_node)
        _apply_health(device, health)
        if annotations is not None:
            note = merge_for_device(annotations, device.uid, device.memdev_serials)
            device.media = note.media or device.media
            device.recycled = bool(note.recycled)
            device.provenance = note.provenance
            device.cost_per_gib_month = note.cost_per_gib_month
    devices.sort(key=lambda d: (d.kind, d.uid))
    return devices


def _apply_health(device: PoolDevice, health: HealthReport | None) -> None:
    """A device is as healthy as its worst memdev; without cxl-cli it is unknown."""
    if health is None or health.tool != "available" or not device.memdev_serials:
        return
    entries = [health.for_serial(s) for s in device.memdev_serials]
    device.health = worst([e.state if e else "unknown" for e in entries])
    device.health_reasons = [
        f"serial {e.serial}: {reason}" for e in entries if e for reason in e.reasons
    ]
