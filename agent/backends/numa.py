"""How does a lease on far memory online as a (CPU-less) NUMA node become memory there?

A ``memfd`` whose pages are bound to the node with ``mbind(MPOL_BIND)``, prefaulted,
checked page by page with ``move_pages(2)``, then sealed against growth and shrinking
(DESIGN.md "Agent: backends").

* The policy is set on a shared mapping of the memfd: for shmem (and hugetlbfs) that
  makes it the file's *shared* policy, so every later fault, in the tenant too, follows it.
* Prefault is ``MADV_POPULATE_WRITE`` (Linux 5.14+): an allocation that the node cannot
  satisfy fails here with an errno instead of SIGBUS in the tenant.
* Placement is verified: a single page on another node is ``backend_failed``, never a
  silent fallback to wherever the kernel found memory.
* Hugepage modes: ``off`` (base pages), ``required`` (2 MiB pages from the node's
  ``hugepages-2048kB`` pool, via ``MFD_HUGETLB``; failure is an error) and ``prefer``
  (2 MiB when the node's pool has them, else base pages). The lease reports the page
  size it actually got.

Revoking a memfd cannot take back pages a live process maps: the agent closes its fd and
counts the bytes as held by a revoked holder until that process exits (service side).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from pathlib import Path
from typing import Literal

from agent.backends import Materialised
from agent.backends import numa_sys as sys_numa
from agent.backends.emulated import LEASE_SEALS, _memfd_name
from poold.api.schemas import DeviceKind
from poold.errors import BackendFailed, InvalidSize

log = logging.getLogger(__name__)

HugepageMode = Literal["off", "prefer", "required"]
HUGE_2M = 2 << 20
_VERIFY_BATCH = 65536  # addresses per move_pages call


def node_free_hugepages(node: int, sysfs_root: Path = Path("/sys")) -> int | None:
    """Free 2 MiB pages in the node's pool, or None when the kernel does not say."""
    path = (
        Path(sysfs_root)
        / f"devices/system/node/node{node}/hugepages/hugepages-2048kB/free_hugepages"
    )
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def pages_off_node(fd: int, length_bytes: int, page_bytes: int, node: int) -> dict[int, int]:
    """Map the memfd, ask the kernel where each page lives; {page index: node or -errno}
    for every page that is not on ``node``. move_pages(2) looks at this process's page
    tables, so the pages are mapped first with MADV_POPULATE_READ (allocates nothing
    for a prefaulted memfd)."""
    address = sys_numa.map_shared(fd, length_bytes)
    wrong: dict[int, int] = {}
    try:
        sys_numa.madvise(address, length_bytes, sys_numa.MADV_POPULATE_READ)
        pages = length_bytes // page_bytes
        for first in range(0, pages, _VERIFY_BATCH):
            batch = range(first, min(pages, first + _VERIFY_BATCH))
            status = sys_numa.page_nodes([address + i * page_bytes for i in batch])
            wrong.update((i, s) for i, s in zip(batch, status, strict=True) if s != node)
    finally:
        sys_numa.unmap(address, length_bytes)
    return wrong


def _bound_memfd(node: int, length_bytes: int, name: str, huge: bool) -> int:
    """A memfd of ``length_bytes`` whose pages were faulted in under MPOL_BIND to ``node``."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    if huge:
        flags |= sys_numa.MFD_HUGETLB | sys_numa.MFD_HUGE_2MB
    fd = os.memfd_create(_memfd_name(name), flags)
    try:
        os.ftruncate(fd, length_bytes)
        address = sys_numa.map_shared(fd, length_bytes)
        try:
            # MPOL_MF_STRICT: the memfd is new, so there is nothing to move; it only
            # makes the kernel say so if something was allocated elsewhere already.
            sys_numa.mbind(
                address, length_bytes, sys_numa.MPOL_BIND, [node], sys_numa.MPOL_MF_STRICT
            )
            sys_numa.madvise(address, length_bytes, sys_numa.MADV_POPULATE_WRITE)
        finally:
            sys_numa.unmap(address, length_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


class NumaBackend:
    """The :class:`agent.backends.Backend` for memfds bound to one NUMA node."""

    def __init__(
        self,
        node: int | None = None,
        hugepages: HugepageMode = "off",
        sysfs_root: Path = Path("/sys"),
    ) -> None:
        self.node = node
        self.hugepages: HugepageMode = hugepages
        self.sysfs_root = Path(sysfs_root)

    @property
    def name(self) -> DeviceKind:
        return "numa"

    def materialise(self, length_bytes: int, name: str) -> Materialised:
        """On the backend's configured node (see :meth:`materialise_on`)."""
        if self.node is None:
            raise BackendFailed("the numa backend needs the lease's node (materialise_on)")
        return self.materialise_on(self.node, length_bytes, name, self.hugepages)

    def materialise_on(
        self,
        node: int,
        length_bytes: int,
        name: str,
        hugepages: HugepageMode = "off",
    ) -> Materialised:
        """A prefaulted, sealed memfd of exactly ``length_bytes``, every page on ``node``."""
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
        try:
            wrong = pages_off_node(fd, length_bytes, page_bytes, node)
            if wrong:
                sample = dict(list(wrong.items())[:4])
                raise BackendFailed(
                    f"{len(wrong)} of {length_bytes // page_bytes} pages are not on node "
                    f"{node} (page: node or -errno {sample})",
                    node=node,
                    pages_off_node=len(wrong),
                )
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, LEASE_SEALS)
        except OSError as err:
            os.close(fd)
            raise BackendFailed(f"numa lease on node {node}: {err}", errno=err.errno) from err
        except BaseException:
            os.close(fd)
            raise
        return Materialised(
            fd=fd,
            backend="numa",
            length_bytes=length_bytes,
            page_size_bytes=page_bytes,
            numa_node=node,
        )

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
        try:
            return _bound_memfd(node, length_bytes, name, huge=False), mmap.PAGESIZE
        except OSError as err:
            hint = " (node out of memory?)" if err.errno in (errno.ENOMEM, errno.EFAULT) else ""
            raise BackendFailed(
                f"could not materialise {length_bytes} bytes on node {node}: {err}{hint}",
                node=node,
                errno=err.errno,
            ) from err

    def release(self, materialised: Materialised) -> None:
        """Close the agent's fd; the pages go back to the node when the tenant's are gone too."""
        os.close(materialised.fd)
