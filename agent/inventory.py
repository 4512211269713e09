"""What this agent offers poold: discovered far memory, or an emulated device when there is none.

Only device kinds the agent has a backend for are offered: advertising memory
the agent cannot hand out would make every lease placed there fail.
"""

from __future__ import annotations

import logging
import os

from agent.config import AgentConfig
from poold.api.schemas import InventoryDevice
from poold.extents import align_down

log = logging.getLogger("pool_agent.inventory")


def mem_total_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def emulated_device(config: AgentConfig) -> InventoryDevice:
    alignment = config.emulated_alignment_bytes
    capacity = config.emulated_capacity_bytes or mem_total_bytes() // 4
    return InventoryDevice(
        uid=f"emulated:{config.host}",
        kind="emulated",
        media="emulated",
        capacity_bytes=align_down(capacity, alignment),
        alignment_bytes=alignment,
        health="ok",
        local_name="memfd",
        numa_node=None,
    )


def discovered_devices(config: AgentConfig, kinds: set[str]) -> list[InventoryDevice]:
    """Far memory found under the sysfs root, limited to kinds with a backend."""
    try:
        from agent.discovery.inventory import discover, to_wire
    except ImportError:
        return []
    try:
        found = to_wire(discover(config.sysfs_root), config.host)
    except Exception:  # discovery must never keep the agent from serving
        log.exception("discovery failed; offering no far memory")
        return []
    usable = [d for d in found if d.kind in kinds]
    skipped = len(found) - len(usable)
    if skipped:
        log.warning("%d far-memory device(s) found but no backend serves their kind yet", skipped)
    return usable


def host_inventory(config: AgentConfig, backend_kinds: set[str]) -> list[InventoryDevice]:
    devices = discovered_devices(config, backend_kinds - {"emulated"})
    if config.emulated or (config.emulated is None and not devices):
        devices.append(emulated_device(config))
    return devices
