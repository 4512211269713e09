"""A numa device's capacity: what its node can really give, less a reserve, kept current.

The numbers of the QEMU guest (issue 13): a 512 MiB CXL node whose MemTotal poold used to
offer, while the node could give 484110336 bytes; a lease poold accepted then failed in
the backend. Faked at the sysfs boundary: the node's meminfo in a recorded machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from agent.discovery.hotplug import RescanScheduler
from agent.discovery.inventory import discover
from agent.discovery.model import (
    DEFAULT_NUMA_RESERVE_BYTES,
    NUMA_CAPACITY_STEP_BYTES,
    numa_capacity_bytes,
)
from agent.discovery.numa import Node

MiB = 1 << 20
KiB = 1 << 10


def cpu_less(**meminfo: int) -> Node:
    return Node(node=1, online=True, has_cpu=False, has_memory=True, **meminfo)


def test_capacity_is_what_the_node_gives_not_memtotal() -> None:
    # The guest's node: 512 MiB total, 484110336 bytes free + reclaimable.
    node = cpu_less(
        mem_total_bytes=536870912,
        mem_free_bytes=470000000,
        file_lru_bytes=10000000,
        kreclaimable_bytes=4110336,
        shmem_bytes=0,
    )
    capacity = numa_capacity_bytes(node)
    assert capacity <= 484110336 - DEFAULT_NUMA_RESERVE_BYTES
    assert capacity > 484110336 - DEFAULT_NUMA_RESERVE_BYTES - NUMA_CAPACITY_STEP_BYTES
    assert capacity % NUMA_CAPACITY_STEP_BYTES == 0
    assert numa_capacity_bytes(node, reserve_bytes=0) == 448 * MiB  # 461.7 MiB, 16 MiB steps
    # Leases' memfd pages are shmem: still part of the capacity (the ledger counts them).
    leased = node.model_copy(
        update={"mem_free_bytes": 470000000 - 200 * MiB, "shmem_bytes": 200 * MiB}
    )
    assert numa_capacity_bytes(leased) == capacity
    # Never more than MemTotal, never below 0; no MemFree: MemTotal less the reserve.
    assert numa_capacity_bytes(node.model_copy(update={"shmem_bytes": 1 << 40})) == (
        512 * MiB - DEFAULT_NUMA_RESERVE_BYTES
    )
    assert numa_capacity_bytes(node, reserve_bytes=1 << 40) == 0
    assert numa_capacity_bytes(cpu_less(mem_total_bytes=512 * MiB)) == 448 * MiB


def _meminfo(node: int, total_kib: int, free_kib: int) -> str:
    rows = {
        "MemTotal": total_kib,
        "MemFree": free_kib,
        "MemUsed": total_kib - free_kib,
        "Active(file)": 0,
        "Inactive(file)": 2048,
        "Shmem": 0,
        "KReclaimable": 1024,
        "SReclaimable": 1024,
    }
    return "".join(f"Node {node} {k}: {v:>12} kB\n" for k, v in rows.items())


def test_capacity_follows_the_nodes_meminfo_at_each_rescan(
    fresh_machine: Callable[[str], Path],
) -> None:
    root = fresh_machine("qemu-full-04-system-ram")
    first = discover(root)
    (numa,) = [d for d in first.devices if d.kind == "numa"]
    assert numa.numa_node is not None
    meminfo = root / f"devices/system/node/node{numa.numa_node}/meminfo"
    total_kib = 256 * 1024
    meminfo.write_text(_meminfo(numa.numa_node, total_kib, 200 * 1024))
    before = next(d for d in discover(root).devices if d.kind == "numa").capacity_bytes
    assert before == 128 * MiB  # (200 MiB + 3 MiB) - 64 MiB reserve, in 16 MiB steps
    # Something else took memory on the node: the next scan offers less.
    meminfo.write_text(_meminfo(numa.numa_node, total_kib, 100 * 1024))
    after = next(d for d in discover(root).devices if d.kind == "numa").capacity_bytes
    assert after == 32 * MiB
    # A configured reserve (the agent's numa_reserve_bytes) is taken off as well.
    reserved = discover(root, numa_reserve_bytes=16 * MiB)
    assert next(d for d in reserved.devices if d.kind == "numa").capacity_bytes == 80 * MiB
    assert os.path.exists(meminfo)


class _Quiet:
    """A udev source that never has an event."""

    def poll(self, timeout_s: float) -> str | None:
        return None


def test_udev_mode_rescans_every_interval_without_events() -> None:
    """The capacity moves without uevents: udev mode rescans at the fallback interval too."""
    now = [0.0]
    fired: list[float] = []

    class Source(_Quiet):
        def poll(self, timeout_s: float) -> str | None:
            now[0] += timeout_s
            return None

    sched = RescanScheduler(
        lambda: fired.append(now[0]),
        Source(),
        fallback_interval_s=30,
        clock=lambda: now[0],
    )
    assert not sched.periodic
    for _ in range(3):
        sched.step()
    assert fired == [30.0, 60.0, 90.0]
