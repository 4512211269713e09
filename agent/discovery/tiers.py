"""Which memory tier does the kernel put each NUMA node in?

Reads ``/sys/devices/virtual/memory_tiering/memory_tierN/nodelist`` (Linux 6.1+). A tier's
id grows with its abstract distance, so a higher id is slower memory: the kernel's own
latency/bandwidth class for a node.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent.discovery.sysfs import SysfsReader, numbered


class MemoryTier(BaseModel):
    """One memory tier and the nodes in it."""

    tier: int
    nodes: list[int] = Field(default_factory=list)


class TierInventory(BaseModel):
    """All memory tiers; absent on kernels before 6.1."""

    present: bool = False
    tiers: list[MemoryTier] = Field(default_factory=list)

    def tier_of(self, node: int) -> int | None:
        """The tier id holding ``node``."""
        return next((t.tier for t in self.tiers if node in t.nodes), None)


def read_tiers(r: SysfsReader) -> TierInventory:
    """Read every ``memory_tierN``."""
    base = r.path("devices", "virtual", "memory_tiering")
    if not base.is_dir():
        return TierInventory(present=False)
    tiers: list[MemoryTier] = []
    for name in numbered(r.listdir(base), "memory_tier"):
        nodes = r.read_list(base / name / "nodelist")
        tiers.append(MemoryTier(tier=int(name.removeprefix("memory_tier")), nodes=nodes or []))
    return TierInventory(present=True, tiers=tiers)
