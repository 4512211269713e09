"""Where a pool device lives on this host, as the agent's memory side reads it."""

from __future__ import annotations

from agent.memory import LocalDevice, local_device
from poold.wire.agent import InventoryDevice


def test_local_device_reads_the_dax_region_off_the_inventory_name() -> None:
    def dev(kind: str, local_name: str, node: int | None = None) -> InventoryDevice:
        return InventoryDevice(
            uid="u",
            kind=kind,
            capacity_bytes=1 << 30,  # type: ignore[arg-type]
            local_name=local_name,
            numa_node=node,
        )

    assert local_device(dev("devdax", "dax_region3")) == LocalDevice("devdax", 3, None)
    assert local_device(dev("devdax", "dax2.0")) == LocalDevice("devdax", 2, None)
    assert local_device(dev("numa", "node2", 2)) == LocalDevice("numa", None, 2)
