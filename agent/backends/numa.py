"""How does a lease on far memory online as a (CPU-less) NUMA node become memory there?

A ``memfd`` whose pages are allocated on the node under ``MPOL_BIND`` (prefaulted), whose
later allocations stay bound, checked for placement, then sealed against growth and
shrinking (DESIGN.md "Agent: backends").

Allocation, in the order :func:`_bound_memfd` does it:

* Prefault is ``fallocate`` on the new memfd, run with the calling thread's policy set to
  ``MPOL_BIND, {node}`` (set_mempolicy(2), restored right after; other threads keep
  theirs). ``shmem_fallocate()`` allocates every page through ``shmem_alloc_folio()`` ->
  ``shmem_get_pgoff_policy()``, which takes the file's shared policy or, when it has none,
  the task's (mm/shmem.c, Linux 6.18); ``hugetlbfs_fallocate()`` takes the task policy too.
  No page tables are built: measured here, ``MADV_POPULATE_WRITE`` through a bound mapping
  (this backend's earlier method) cost ~3x as much, because it zeroes every page and
  builds, then throws away, page tables for a million pages. As with the emulated
  backend, base pages are zeroed on their first fault (in the tenant), not here.
* Then, for base pages, ``mmap`` + ``mbind(MPOL_BIND, {node})`` + ``munmap``: on a shmem
  mapping mbind goes through ``shmem_set_policy()`` and sets the file's *shared* policy
  (``mpol_set_shared_policy()``), which outlives the mapping, so every later allocation
  for the file (the tenant's swap-ins) stays bound. It is set after the fallocate, not
  before, because looking it up for each page costs: measured on 4 GiB, fallocate under a
  shared policy took 1.07x a plain one, under the thread policy 1.04x. The QEMU guest
  tests show every page of such a lease on a CPU-less CXL node (Linux 6.12).
* Hugepages have no shared policy (``hugetlb_vm_ops`` has no ``set_policy`` as of 6.18:
  mbind on a hugetlb mapping only sets that VMA's policy), and need none: they are never
  swapped, so every page stays where the fallocate put it.
* Out of memory: under MPOL_BIND the page allocator never falls back to another node, but
  a shmem allocation it cannot satisfy does not fail with ENOSPC or ENOMEM either (the
  internal shm mount has no size limit): the allocator reclaims, retries, and in the end
  calls the OOM killer, which may pick any process whose own policy does not exclude the
  node. In the QEMU guest (Linux 6.12), fallocate of 400 MiB bound to a 256 MiB CXL node
  was still stuck in reclaim after 120 s, without an error. So a base-page lease is first
  checked against what the node can still give (:func:`node_available_bytes`, a per-node
  ``MemAvailable``) and refused with ENOMEM when it does not fit. Two allocations racing
  for the last free memory of a node can still both pass; the ledger's per-device
  capacity is what keeps that from happening. Hugepages come from the node's pool, which
  fallocate reports empty with ENOSPC (hugetlb does not call the OOM killer).
* The price of binding the thread rather than the file: while it is bound, the kernel
  memory the fallocate allocates (page-cache xarray nodes, ~0.2% of the lease, in slab
  pages that other objects may share later) comes from the node too, unless all of the
  node's memory is ZONE_MOVABLE (``daxctl online-memory`` defaults to movable), for which
  ``apply_policy_zone()`` leaves kernel allocations unbound. kmem's auto-online in the QEMU
  guest puts the CXL node in ZONE_NORMAL, where the kernel may place any unmovable
  allocation anyway. Binding the file first keeps kernel memory local, for ~3% more time.

Hugepage modes: ``off`` (base pages), ``required`` (2 MiB pages from the node's
``hugepages-2048kB`` pool, via ``MFD_HUGETLB``; failure is an error) and ``prefer`` (2 MiB
when the node's pool has them, else base pages). The lease reports the page size it
actually got.

Placement verification (:meth:`NumaBackend._verify`) is belt-and-braces; MPOL_BIND is the
guarantee. With a bind policy the allocator only walks the zones of the bound nodes (the
nodemask filters the zonelist) and fails rather than fall back, so no kernel path puts
single pages elsewhere at random. What can go wrong is systematic: the policy not reaching
the allocator at all (a kernel whose fallocate ignores the task policy, a cpuset whose
mems exclude the node, which makes ``policy_nodemask()`` drop the nodemask) moves *every*
page; a binding that covers only part of the allocation (a length or offset bug, a cpuset
change half-way) misplaces a *contiguous run* of file offsets. So the check is:

* for base pages, the file's shared policy as a fresh mapping (like the tenant's) sees it
  at its first and last page: must be MPOL_BIND to exactly ``{node}``;
* ``move_pages(2)`` on a sample (:func:`sample_pages`): the first and last page, and one
  page every length / :data:`PLACEMENT_SAMPLES` from a random start (every page of a
  lease with no more pages than that). A wrong policy is caught by any one page; a
  misplaced contiguous run of at least length / 1024 (4 MiB of a 4 GiB lease) always
  contains a sampled page; a scattered fraction *f* of misplaced pages, for which no
  mechanism is known, would escape with probability about (1 - *f*) ** 1024 (*f* = 1%:
  3e-5).

A page on another node is ``backend_failed``, never a silent fallback to wherever the kernel
found memory. The check costs about the same for any lease size over 4 MiB (a read fault,
which zeroes the page, and a page-table page per sampled page): ~13 ms for 4 GiB on a quiet
host, 20-80 ms under load, where checking all pages of 4 GiB cost ~1 s.

Revoking a memfd cannot take back pages a live process maps: the agent closes its fd and
counts the bytes as held by a revoked holder until that process exits (agent/revocation.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from agent.backends import Materialised, OnCarve, Placement
from agent.backends import numa_sys as sys_numa
from agent.backends.emulated import (
    MemfdMaterialised,
    NoSubDevices,
    _memfd_name,
    lease_seals,
    populate,
)
from agent.discovery.sysfs import SysfsReader
from poold.errors import BackendFailed, InvalidSize
from poold.wire.common import DeviceKind

log = logging.getLogger(__name__)

HugepageMode = Literal["off", "prefer", "required"]
HUGE_2M = 2 << 20
PLACEMENT_SAMPLES = 1024  # pages (plus first and last) the placement check looks at
_VERIFY_BATCH = 65536  # addresses per move_pages call


def node_free_hugepages(node: int, sysfs_root: Path = Path("/sys")) -> int | None:
    """Free 2 MiB pages in the node's pool, or None when the kernel does not say."""
    reader = SysfsReader(Path(sysfs_root))
    pool = reader.path("devices/system/node", f"node{node}", "hugepages/hugepages-2048kB")
    return reader.read_int(pool / "free_hugepages", base=10, probe=True)


def _node_meminfo_kib(node: int, sysfs_root: Path) -> dict[str, int] | None:
    """``/sys/devices/system/node/nodeN/meminfo`` as {field: kB}; None if absent."""
    reader = SysfsReader(Path(sysfs_root))
    text = reader.read_str(reader.path("devices/system/node", f"node{node}", "meminfo"), probe=True)
    if text is None:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        # "Node 0 MemFree:        21877100 kB"
        parts = line.split()
        if len(parts) >= 4 and parts[2].endswith(":"):
            try:
                fields[parts[2][:-1]] = int(parts[3])
            except ValueError:
                continue
    return fields


def _node_watermarks_pages(node: int, proc_root: Path) -> tuple[int, int]:
    """The node's zones' summed (low, high) watermarks from /proc/zoneinfo; (0, 0) if absent."""
    low = high = 0
    try:
        text = (Path(proc_root) / "zoneinfo").read_text()
    except OSError:
        return 0, 0
    inside = False
    for line in text.splitlines():
        if line.startswith("Node "):
            # "Node 0, zone   Normal"
            inside = line.split(",", 1)[0] == f"Node {node}"
            continue
        if not inside:
            continue
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            if parts[0] == "low":
                low += int(parts[1])
            elif parts[0] == "high":
                high += int(parts[1])
    return low, high


def node_available_bytes(
    node: int, sysfs_root: Path = Path("/sys"), proc_root: Path = Path("/proc")
) -> int | None:
    """What a bound allocation can still get from ``node`` without the OOM killer: the
    node's share of ``MemAvailable``, or None when the kernel does not say.

    The kernel reports MemAvailable for the whole host only; this is the same estimate
    (``si_mem_available()``, mm/show_mem.c) over the node's counters: free pages above the
    high watermarks, plus the file LRU and reclaimable kernel memory that reclaim could
    free, each less min(half, low watermarks). ``lowmem_reserve``, which the kernel also
    reserves, is left out: it protects DMA zones, not the node's Normal/Movable memory.
    """
    info = _node_meminfo_kib(node, sysfs_root)
    if info is None or "MemFree" not in info:
        return None
    page_kib = mmap.PAGESIZE // 1024
    low_pages, high_pages = _node_watermarks_pages(node, proc_root)
    low_kib, high_kib = low_pages * page_kib, high_pages * page_kib
    pagecache = info.get("Active(file)", 0) + info.get("Inactive(file)", 0)
    reclaimable = info.get("KReclaimable", info.get("SReclaimable", 0))
    available = info["MemFree"] - high_kib
    available += pagecache - min(pagecache // 2, low_kib)
    available += reclaimable - min(reclaimable // 2, low_kib)
    return max(available, 0) * 1024


def sample_pages(page_count: int, samples: int = PLACEMENT_SAMPLES) -> list[int]:
    """Page indices for the placement check: every page when there are at most
    ``samples + 2``; else the first and last page and every ``ceil(page_count / samples)``-th
    page from a random start, so that any run of that many pages holds a checked one."""
    if page_count <= samples + 2:
        return list(range(page_count))
    stride = -(-page_count // samples)
    # A fresh start per lease: no page offset is left out of every check.
    start = secrets.randbelow(stride)
    return sorted({0, page_count - 1, *range(start, page_count, stride)})


def _off_node_at(
    address: int, length_bytes: int, page_bytes: int, node: int, pages: Sequence[int] | None
) -> dict[int, int]:
    """{page index: node or -errno} for the pages (all when ``pages`` is None) of the
    mapping at ``address`` that are not on ``node``. move_pages(2) looks at this process's
    page tables, so the pages are mapped first with MADV_POPULATE_READ (which allocates
    nothing for a prefaulted memfd)."""
    page_count = length_bytes // page_bytes
    if pages is None or len(pages) == page_count:
        # One call for the whole range: far cheaper than a call per page.
        sys_numa.madvise(address, length_bytes, sys_numa.MADV_POPULATE_READ)
        pages = range(page_count) if pages is None else pages
    else:
        for index in pages:
            sys_numa.madvise(address + index * page_bytes, page_bytes, sys_numa.MADV_POPULATE_READ)
    wrong: dict[int, int] = {}
    for first in range(0, len(pages), _VERIFY_BATCH):
        batch = pages[first : first + _VERIFY_BATCH]
        status = sys_numa.page_nodes([address + i * page_bytes for i in batch])
        wrong.update((i, s) for i, s in zip(batch, status, strict=True) if s != node)
    return wrong


def pages_off_node(
    fd: int,
    length_bytes: int,
    page_bytes: int,
    node: int,
    pages: Sequence[int] | None = None,
) -> dict[int, int]:
    """Map the memfd, ask the kernel where each page lives (every page, or only the
    indices in ``pages``); {page index: node or -errno} for each one not on ``node``."""
    address = sys_numa.map_shared(fd, length_bytes)
    try:
        return _off_node_at(address, length_bytes, page_bytes, node, pages)
    finally:
        sys_numa.unmap(address, length_bytes)


def _bound_memfd(node: int, length_bytes: int, name: str, huge: bool) -> int:
    """A memfd of ``length_bytes`` whose pages were allocated under MPOL_BIND to ``node``."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    if huge:
        flags |= sys_numa.MFD_HUGETLB | sys_numa.MFD_HUGE_2MB
    fd = os.memfd_create(_memfd_name(name), flags)
    try:
        os.ftruncate(fd, length_bytes)
        # The thread is bound, not yet the file: a shared policy is looked up for every
        # page allocated, which made this fallocate ~3% slower (module docstring).
        with sys_numa.bound_thread(sys_numa.MPOL_BIND, [node]):
            os.posix_fallocate(fd, 0, length_bytes)
        if not huge:
            # The file's shared policy, for allocations after this one (module docstring).
            address = sys_numa.map_shared(fd, length_bytes)
            try:
                sys_numa.mbind(address, length_bytes, sys_numa.MPOL_BIND, [node])
            finally:
                sys_numa.unmap(address, length_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


class NumaBackend(NoSubDevices):
    """The :class:`agent.backends.Backend` for memfds bound to one NUMA node.

    ``hugepages`` is the page size mode of every lease it makes (the agent's config).
    """

    def __init__(
        self,
        node: int | None = None,
        hugepages: HugepageMode = "off",
        sysfs_root: Path = Path("/sys"),
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.node = node
        self.hugepages: HugepageMode = hugepages
        self.sysfs_root = Path(sysfs_root)
        self.proc_root = Path(proc_root)

    @property
    def name(self) -> DeviceKind:
        return "numa"

    def materialise(
        self, length_bytes: int, name: str, *, shrinkable: bool = False
    ) -> Materialised:
        """On the backend's configured node (see :meth:`materialise_on`)."""
        if self.node is None:
            raise BackendFailed("the numa backend needs the lease's node (materialise_on)")
        return self.materialise_on(
            self.node, length_bytes, name, self.hugepages, shrinkable=shrinkable
        )

    def materialise_placed(
        self,
        placement: Placement,
        name: str,
        *,
        shrinkable: bool = False,
        on_carve: OnCarve | None = None,
    ) -> Materialised:
        """On the placement's node, in the hugepage mode the tenant asked (else the
        backend's), populated when asked."""
        if placement.numa_node is None:
            raise BackendFailed(f"device {placement.device_uid} has no NUMA node on this host")
        mode = placement.hugepages or self.hugepages
        if mode not in ("off", "prefer", "required"):
            raise InvalidSize(f"unknown hugepages mode {mode!r}")
        return self.materialise_on(
            placement.numa_node,
            placement.length_bytes,
            name,
            mode,  # type: ignore[arg-type]  # checked above
            shrinkable=shrinkable,
            populate_pages=placement.populate,
        )

    def materialise_on(
        self,
        node: int,
        length_bytes: int,
        name: str,
        hugepages: HugepageMode = "off",
        *,
        shrinkable: bool = False,
        populate_pages: bool = False,
    ) -> Materialised:
        """A prefaulted, sealed memfd of exactly ``length_bytes``, every page on ``node``.

        ``shrinkable``: not sealed against shrinking (the agent's ``shrink`` may cut it;
        the pages given back return to the node). ``populate_pages``: every page also
        zeroed and faulted in before the tenant sees it (a pin-ready lease)."""
        if length_bytes <= 0:
            raise InvalidSize(f"lease length must be positive, got {length_bytes}")
        if hugepages == "required" and length_bytes % HUGE_2M:
            raise InvalidSize(
                f"a hugepage lease must be a multiple of 2 MiB, got {length_bytes}",
                length_bytes=length_bytes,
            )
        if not (self.sysfs_root / f"devices/system/node/node{node}").is_dir():
            raise BackendFailed(f"NUMA node {node} does not exist on this host", node=node)
        fd, page_bytes = self._allocate(node, length_bytes, name, hugepages)
        populated = False
        try:
            if populate_pages:  # the pages exist (bound fallocate): this zeroes them
                populated = populate(fd, length_bytes, page_bytes)
            self._verify(fd, node, length_bytes, page_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, lease_seals(shrinkable))
        except OSError as err:
            os.close(fd)
            raise BackendFailed(f"numa lease on node {node}: {err}", errno=err.errno) from err
        except BaseException:
            os.close(fd)
            raise
        return MemfdMaterialised(
            fd=fd,
            backend="numa",
            length_bytes=length_bytes,
            page_size_bytes=page_bytes,
            numa_node=node,
            populated=populated,
        )

    def _verify(self, fd: int, node: int, length_bytes: int, page_bytes: int) -> None:
        """Placement, sampled (see the module docstring): BackendFailed when wrong."""
        pages = sample_pages(length_bytes // page_bytes)
        address = sys_numa.map_shared(fd, length_bytes)
        try:
            wrong = _off_node_at(address, length_bytes, page_bytes, node, pages)
            if wrong:
                shown = dict(list(wrong.items())[:4])
                raise BackendFailed(
                    f"{len(wrong)} of {len(pages)} sampled pages are not on node {node} "
                    f"(page: node or -errno {shown})",
                    node=node,
                    pages_off_node=len(wrong),
                    pages_checked=len(pages),
                )
            if page_bytes == HUGE_2M:
                return  # hugetlbfs: no shared policy to check; every page exists already
            for offset in (0, length_bytes - page_bytes):
                mode, nodes = sys_numa.address_policy(address + offset)
                if (mode, nodes) != (sys_numa.MPOL_BIND, [node]):
                    raise BackendFailed(
                        f"the memfd's policy at offset {offset} is mode {mode} on nodes "
                        f"{nodes}, not MPOL_BIND to node {node}: the tenant's faults would "
                        "not be bound",
                        node=node,
                        policy_mode=mode,
                        policy_nodes=nodes,
                    )
        finally:
            sys_numa.unmap(address, length_bytes)

    def _allocate(
        self, node: int, length_bytes: int, name: str, hugepages: HugepageMode
    ) -> tuple[int, int]:
        if hugepages != "off" and length_bytes % HUGE_2M == 0:
            free = node_free_hugepages(node, self.sysfs_root)
            enough = free is not None and free * HUGE_2M >= length_bytes
            if enough:
                try:
                    return _bound_memfd(node, length_bytes, name, huge=True), HUGE_2M
                except OSError as err:
                    if hugepages == "required":
                        raise BackendFailed(
                            f"no {length_bytes} bytes of 2 MiB pages on node {node}: "
                            f"{err.strerror}",
                            node=node,
                            errno=err.errno,
                        ) from err
                    log.info("node %d: hugepages failed (%s), using base pages", node, err)
            elif hugepages == "required":
                raise BackendFailed(
                    f"node {node} has {free} free 2 MiB pages, the lease needs "
                    f"{length_bytes // HUGE_2M}",
                    node=node,
                )
        # Reading the node's meminfo and /proc/zoneinfo costs well under a millisecond.
        available = node_available_bytes(node, self.sysfs_root, self.proc_root)
        if available is not None and length_bytes > available:
            raise BackendFailed(
                f"node {node} has {available} bytes available, the lease needs "
                f"{length_bytes} (node out of memory)",
                node=node,
                errno=errno.ENOMEM,
                available_bytes=available,
            )
        try:
            return _bound_memfd(node, length_bytes, name, huge=False), mmap.PAGESIZE
        except OSError as err:
            hint = (
                " (node out of memory?)"
                if err.errno in (errno.ENOMEM, errno.ENOSPC, errno.EINTR)
                else ""
            )
            raise BackendFailed(
                f"could not materialise {length_bytes} bytes on node {node}: {err}{hint}",
                node=node,
                errno=err.errno,
            ) from err

    def release(self, materialised: Materialised) -> None:
        """Close the agent's fd; the pages go back to the node when the tenant's are gone too."""
        os.close(materialised.fd)
