"""What does this host have to offer the pool, right now?

:func:`discover` runs every reader against one sysfs root and builds the pool devices;
:func:`to_wire` maps them onto poold's ``InventoryDevice``. A broken tree never raises:
whatever could not be read is a warning in ``Inventory.warnings`` and an unknown field.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from pydantic import BaseModel, Field

from agent.discovery.annotations import Annotations
from agent.discovery.cxl import CxlInventory, read_cxl
from agent.discovery.dax import DaxInventory, read_dax
from agent.discovery.health import CommandRunner, HealthReport, read_health, system_runner
from agent.discovery.model import DEFAULT_NUMA_RESERVE_BYTES, PoolDevice, build_pool_devices
from agent.discovery.numa import NumaInventory, read_numa
from agent.discovery.sysfs import SysfsReader
from agent.discovery.tiers import TierInventory, read_tiers
from poold.wire.agent import InventoryDevice

LIVE_SYSFS = Path("/sys")


class Inventory(BaseModel):
    """Raw readings per subsystem, the pool devices built from them, and what went wrong."""

    sysfs_root: str
    cxl: CxlInventory
    dax: DaxInventory
    numa: NumaInventory
    tiers: TierInventory
    health: HealthReport
    devices: list[PoolDevice] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


def discover(
    sysfs_root: Path = LIVE_SYSFS,
    annotations: Annotations | None = None,
    run_cxl: CommandRunner | None = None,
    numa_reserve_bytes: int = DEFAULT_NUMA_RESERVE_BYTES,
) -> Inventory:
    """Read everything under ``sysfs_root`` and build the pool devices.

    ``run_cxl`` runs cxl-cli for health. When not given, the real tool is used only for the
    live /sys: the host's cxl-cli knows nothing about a fixture tree.
    """
    reader = SysfsReader(Path(sysfs_root))
    cxl = read_cxl(reader)
    dax = read_dax(reader)
    numa = read_numa(reader)
    tiers = read_tiers(reader)
    if run_cxl is None and Path(sysfs_root) == LIVE_SYSFS and cxl.present:
        run_cxl = system_runner
    health = read_health(run_cxl) if run_cxl is not None else HealthReport(tool="skipped")
    devices = build_pool_devices(cxl, dax, numa, tiers, health, annotations, numa_reserve_bytes)
    return Inventory(
        sysfs_root=str(sysfs_root),
        cxl=cxl,
        dax=dax,
        numa=numa,
        tiers=tiers,
        health=health,
        devices=devices,
        warnings=reader.warnings + health.warnings,
    )


def wire_uid(device: PoolDevice, host: str) -> str:
    """The ledger uid: host-scoped identities carry the host name."""
    if not device.host_scoped:
        return device.uid
    return f"{host}/{device.uid}"


def reserved_extents(
    device: PoolDevice, own_sub_devices: Collection[str] = ()
) -> list[tuple[int, int]]:
    """(offset, length) ranges of the device held by dax devices not in ``own_sub_devices``.

    ``own_sub_devices`` names the sub-devices the agent carved for leases (its journal, its
    backend): poold placed those, so they are leases, not reserved ranges.
    """
    return sorted(
        extent
        for occupant in device.dax_occupants
        if occupant.device not in own_sub_devices
        for extent in occupant.extents
    )


def to_wire(
    inv: Inventory, host: str, own_sub_devices: Collection[str] = ()
) -> list[InventoryDevice]:
    """Pool devices as poold's ``InventoryDevice`` rows.

    Every dax device in a carvable region not named in ``own_sub_devices`` is reported as
    a reserved extent (:func:`reserved_extents`).
    """
    return [
        InventoryDevice(
            uid=wire_uid(d, host),
            kind=d.kind,
            media=d.media,
            recycled=d.recycled,
            provenance=d.provenance,
            cost_per_gib_month=d.cost_per_gib_month,
            capacity_bytes=d.capacity_bytes,
            alignment_bytes=d.alignment_bytes,
            health=d.health,
            local_name=d.local_name,
            numa_node=d.numa_node,
            read_latency_ns=d.read_latency_ns,
            write_latency_ns=d.write_latency_ns,
            read_bandwidth_mbps=d.read_bandwidth_mbps,
            write_bandwidth_mbps=d.write_bandwidth_mbps,
            distance=d.distance,
            memory_tier=d.memory_tier,
            memdev_serials=d.memdev_serials,
            health_reasons=d.health_reasons,
            reserved_extents=reserved_extents(d, own_sub_devices),
            whole_only=d.whole_only,
        )
        for d in inv.devices
    ]
