"""Which NUMA nodes does this host have, which are CPU-less far memory, and how far are they?

Reads ``/sys/devices/system/node``: the online/has_cpu/has_memory masks, each node's
cpulist, meminfo, distance row and HMAT access coordinates (``accessY/initiators``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from agent.discovery.sysfs import SysfsReader, numbered


class NodeAccess(BaseModel):
    """HMAT performance from a class of initiators to this node (Linux 5.2+)."""

    initiators: list[int] = Field(default_factory=list)
    read_latency_ns: int | None = None
    write_latency_ns: int | None = None
    read_bandwidth_mbps: int | None = None
    write_bandwidth_mbps: int | None = None


class Node(BaseModel):
    """One NUMA node."""

    node: int
    online: bool | None = None
    has_cpu: bool | None = None
    has_memory: bool | None = None
    cpulist: list[int] | None = None
    mem_total_bytes: int | None = None
    mem_free_bytes: int | None = None
    # What reclaim can give back, and what leases (memfds: shmem) hold: with MemFree,
    # what the node can give (agent/discovery/model.py numa_capacity_bytes).
    file_lru_bytes: int | None = None  # Active(file) + Inactive(file)
    kreclaimable_bytes: int | None = None  # KReclaimable (SReclaimable before 4.20)
    shmem_bytes: int | None = None
    distance: list[int] | None = None  # row of the SLIT, indexed by node id
    # access0: nearest initiators of any kind; access1: nearest CPU initiators
    # (access1 appeared in Linux 5.10 with generic initiators).
    access0: NodeAccess | None = None
    access1: NodeAccess | None = None

    @property
    def cpu_less(self) -> bool:
        """Memory but no CPUs: how far memory (CXL, kmem-onlined dax) appears."""
        return bool(self.has_memory) and self.has_cpu is False


class NumaInventory(BaseModel):
    """All NUMA nodes the kernel lists."""

    present: bool = False
    nodes: list[Node] = Field(default_factory=list)

    def node(self, node_id: int) -> Node | None:
        """Node by id."""
        return next((n for n in self.nodes if n.node == node_id), None)


_MEMINFO_FIELDS = (
    "MemTotal:",
    "MemFree:",
    "Active(file):",
    "Inactive(file):",
    "KReclaimable:",
    "SReclaimable:",
    "Shmem:",
)


def _meminfo(r: SysfsReader, path: Path) -> dict[str, int]:
    """{field: bytes} of a per-node meminfo ("Node 2 MemTotal:  524288 kB"), the fields
    discovery uses; {} when unreadable."""
    text = r.read_str(path)
    if text is None:
        return {}
    values: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in _MEMINFO_FIELDS:
            try:
                values[fields[2][:-1]] = int(fields[3]) * (1024 if fields[-1] == "kB" else 1)
            except ValueError:
                r.warn(f"{r.rel(path)}: bad line {line[:40]!r}")
    if "MemTotal" not in values:
        r.warn(f"{r.rel(path)}: no MemTotal")
    return values


def read_access(r: SysfsReader, path: Path) -> NodeAccess | None:
    """``accessY/initiators``: the initiator node links and four performance numbers."""
    initiators = path / "initiators"
    if not initiators.is_dir():
        return None  # no HMAT (QEMU without hmat=on, most desktops)
    entries = r.listdir(initiators)
    return NodeAccess(
        initiators=[int(n.removeprefix("node")) for n in numbered(entries, "node")],
        read_latency_ns=r.read_int(initiators / "read_latency", probe=True),
        write_latency_ns=r.read_int(initiators / "write_latency", probe=True),
        read_bandwidth_mbps=r.read_int(initiators / "read_bandwidth", probe=True),
        write_bandwidth_mbps=r.read_int(initiators / "write_bandwidth", probe=True),
    )


def _distance(r: SysfsReader, path: Path) -> list[int] | None:
    text = r.read_str(path)
    if text is None:
        return None
    try:
        return [int(v) for v in text.split()]
    except ValueError:
        r.warn(f"{r.rel(path)}: not a distance row: {text[:40]!r}")
        return None


def read_numa(r: SysfsReader) -> NumaInventory:
    """Read every ``nodeN``; masks that can't be read leave the flags unknown."""
    base = r.path("devices", "system", "node")
    if not base.is_dir():
        return NumaInventory(present=False)
    online = r.read_list(base / "online")
    has_cpu = r.read_list(base / "has_cpu")
    has_memory = r.read_list(base / "has_memory")
    nodes: list[Node] = []
    for name in numbered(r.listdir(base), "node"):
        node_id = int(name.removeprefix("node"))
        path = base / name
        if not path.is_dir():
            r.warn(f"{r.rel(path)}: vanished during scan")
            continue
        info = _meminfo(r, path / "meminfo")
        file_lru = (
            info.get("Active(file)", 0) + info.get("Inactive(file)", 0)
            if "Active(file)" in info or "Inactive(file)" in info
            else None
        )
        nodes.append(
            Node(
                node=node_id,
                online=None if online is None else node_id in online,
                has_cpu=None if has_cpu is None else node_id in has_cpu,
                has_memory=None if has_memory is None else node_id in has_memory,
                cpulist=r.read_list(path / "cpulist"),
                mem_total_bytes=info.get("MemTotal"),
                mem_free_bytes=info.get("MemFree"),
                file_lru_bytes=file_lru,
                kreclaimable_bytes=info.get("KReclaimable", info.get("SReclaimable")),
                shmem_bytes=info.get("Shmem"),
                distance=_distance(r, path / "distance"),
                access0=read_access(r, path / "access0"),
                access1=read_access(r, path / "access1"),
            )
        )
    return NumaInventory(present=True, nodes=nodes)
