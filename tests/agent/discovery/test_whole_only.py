"""The whole-only marker: a static dax region (recorded pmem namespace in devdax mode) is
offered whole-only, a carvable one is not, and the marker travels on the wire."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agent.discovery.inventory import discover, to_wire


def test_static_pmem_region_is_whole_only_and_carvable_ones_are_not(
    machine_root: Callable[[str], Path],
) -> None:
    inv = discover(machine_root("qemu-full-05-pmem"))
    static = {r.id for r in inv.dax.regions if not r.carvable}
    assert static, "the recording has a pmem namespace in devdax mode"
    devdax = [d for d in inv.devices if d.kind == "devdax"]
    assert {d.dax_region_id for d in devdax if d.whole_only} == static
    wire = {d.local_name: d for d in to_wire(inv, "h1")}
    for d in devdax:
        assert wire[d.local_name].whole_only is d.whole_only
        if d.whole_only:
            # Leased through its one device, never carved: nothing reserved on it, and
            # its capacity is that device's size (what the backend's whole lease takes).
            assert wire[d.local_name].reserved_extents == []
            region = next(r for r in inv.dax.regions if r.id == d.dax_region_id)
            assert d.capacity_bytes == region.size
    assert all(not d.whole_only for d in inv.devices if d.kind == "numa")
