"""How does an engine that cannot drop its host tier give a lease's memory back?

vLLM's CPU offloading region and SGLang's HiCache host pool are fixed for the life of
the engine: their block tables assume every slot stays addressable, and neither can
fail a transfer or forget a tier at run time. A memfd cannot be taken back from a
process that maps it (DESIGN.md "Memory follows the pages"), so on revocation the
adapter moves its tier out of the pool instead: :meth:`LeaseMapping.evacuate` copies
the bytes into private anonymous memory and ``mremap``\\ s that copy over the lease's
range, at the same address. The engine's tensors stay valid and keep their contents;
the lease's pages are no longer mapped, so the lease can be released.

The mapping itself is made the way vLLM maps its multi-file region: an anonymous
placeholder (Python's ``mmap(-1, ...)``, which keeps no duplicate of any fd) with the
lease's fd mapped over it ``MAP_SHARED | MAP_FIXED``. So the only references to the
memfd are the lease's fd and this mapping, and no ftruncate is needed (a lease is
sealed). Aligned to the lease's page size, so hugetlb and devdax leases map too.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any

from agent.client import Lease, PoolClient
from poold.errors import PoolError

log = logging.getLogger(__name__)

_MAP_FIXED = 0x10  # <sys/mman.h>, the same on every Linux architecture
_MAP_ANONYMOUS = 0x20
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_POPULATE_WRITE = 23  # Linux 5.14


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    libc.mremap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    libc.mremap.restype = ctypes.c_void_p
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class LeaseMapping:
    """``length_bytes`` of a lease mapped read/write at an address that never changes."""

    def __init__(self, lease: Lease, length_bytes: int) -> None:
        if length_bytes <= 0 or length_bytes > lease.length_bytes:
            raise ValueError(
                f"cannot map {length_bytes} bytes of lease {lease.lease_id} "
                f"({lease.length_bytes} bytes long)"
            )
        self.lease_id = lease.lease_id
        self.length_bytes = length_bytes
        self.page_size_bytes = max(lease.page_size_bytes, mmap.PAGESIZE)
        # hugetlb and devdax want the address aligned to their page (devdax: its align).
        self._align = max(self.page_size_bytes, lease.alignment_bytes, mmap.PAGESIZE)
        self.mapped_bytes = min(round_up(length_bytes, self.page_size_bytes), lease.length_bytes)
        self.evacuated = False
        self.lock = threading.Lock()  # held across an evacuation
        slack = self._align if self._align > mmap.PAGESIZE else 0
        self._placeholder: mmap.mmap | None = mmap.mmap(
            -1,
            self.mapped_bytes + slack,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        start = ctypes.addressof(ctypes.c_char.from_buffer(self._placeholder))
        self.offset_bytes = round_up(start, self._align) - start
        self.address = start + self.offset_bytes
        got = _libc().mmap(
            self.address,
            self.mapped_bytes,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_SHARED | _MAP_FIXED,
            lease.fd,
            0,
        )
        if got != self.address:
            err = _oserror(f"mapping lease {lease.lease_id}")
            self._placeholder.close()
            self._placeholder = None
            raise err

    def buffer(self) -> memoryview:
        """The mapped bytes, writable; valid until :meth:`close`, evacuated or not."""
        if self._placeholder is None:
            raise ValueError(f"lease {self.lease_id}'s mapping is closed")
        return memoryview(self._placeholder)[
            self.offset_bytes : self.offset_bytes + self.length_bytes
        ]

    def populate(self) -> bool:
        """Fault every page in for writing (``MADV_POPULATE_WRITE``); False where the kernel
        lacks it (before 5.14), then the engine's first touch faults them."""
        if _libc().madvise(self.address, self.mapped_bytes, _MADV_POPULATE_WRITE) == 0:
            return True
        if ctypes.get_errno() == errno.EINVAL:
            return False
        raise _oserror(f"populating lease {self.lease_id}")

    def evacuate(
        self,
        unpin: Callable[[], Any] | None = None,
        repin: Callable[[], Any] | None = None,
    ) -> None:
        """Move the bytes off the lease into private memory at the same address.

        The caller has stopped every transfer into or out of the range (nothing may write
        it during the copy). ``unpin``/``repin`` undo and redo a device registration
        (``cudaHostRegister``) around the move: a registration pins the lease's pages,
        which would keep them (and stale DMA targets) alive.
        """
        if self.evacuated or self._placeholder is None:
            return
        libc = _libc()
        size = self.mapped_bytes
        copy = libc.mmap(
            None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0
        )
        if copy in (None, _MAP_FAILED):
            raise _oserror(f"allocating {size} bytes to evacuate lease {self.lease_id}")
        try:
            ctypes.memmove(copy, self.address, size)
        except BaseException:
            libc.munmap(copy, size)
            raise
        if unpin is not None:
            unpin()
        moved = libc.mremap(copy, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, self.address)
        if moved != self.address:
            err = _oserror(f"moving lease {self.lease_id}'s copy into place")
            libc.munmap(copy, size)
            if repin is not None:
                repin()
            raise err
        self.evacuated = True
        if repin is not None:
            repin()
        log.info("lease %s: %d bytes evacuated to private memory", self.lease_id, size)

    def discard(self) -> None:
        """Drop the lease's pages from the range at once, contents and all (zero pages in
        their place): for an engine shutting down that still holds a view of it."""
        if self._placeholder is None or self.evacuated:
            return
        got = _libc().mmap(
            self.address,
            self.mapped_bytes,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED,
            -1,
            0,
        )
        if got != self.address:
            raise _oserror(f"unmapping lease {self.lease_id}")
        self.evacuated = True

    def close(self) -> None:
        """Unmap (lease or evacuated copy); BufferError while a tensor still views it."""
        if self._placeholder is not None:
            self._placeholder.close()  # munmaps the whole range, whatever is mapped there
            self._placeholder = None

    @property
    def closed(self) -> bool:
        return self._placeholder is None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """What an engine's configuration says about its leases (keys ``pool.<field>``)."""

    socket: str | None = None  # else $POOLD_AGENT_SOCKET, else the agent's default
    media: str | None = None
    tenant: str | None = None
    ttl_s: int = 60
    populate: bool = True  # the agent faults the pages in (both engines prefault anyway)
    hugepages: str | None = None  # off | prefer | required
    numa_node: int | None = None
    report_interval_s: float = 10.0

    @classmethod
    def from_config(cls, values: Mapping[str, Any], prefix: str = "pool.") -> PoolSettings:
        """Read ``pool.*`` keys; an unknown ``pool.`` key or a bad value is a ValueError
        (a typo must not silently lease from the wrong media)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        got: dict[str, Any] = {}
        for key, value in values.items():
            if not key.startswith(prefix) or value is None or value == "":
                continue
            name = key[len(prefix) :]
            if name not in fields:
                raise ValueError(f"unknown setting {key!r}; known: {sorted(fields)}")
            try:
                if name in ("ttl_s", "numa_node"):
                    got[name] = int(value)
                elif name == "report_interval_s":
                    got[name] = float(value)
                elif name == "populate":
                    got[name] = _flag(value, key)
                else:
                    got[name] = str(value)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{key}: {err}") from err
        if got.get("hugepages") not in (None, "off", "prefer", "required"):
            raise ValueError(f"{prefix}hugepages must be off, prefer or required")
        return cls(**got)


Usage = tuple[int, int, int, int, int]  # used, exclusive, replica bytes; exclusive, replica blocks


class PoolTier:
    """An engine's host tier on one poold lease: mapped, renewed, reported, and moved off
    the pool (:meth:`LeaseMapping.evacuate`) when the lease is revoked or lost.

    ``fence`` is the engine's way to stop its transfers for the move: a context manager
    that returns once nothing reads or writes the tier and lets them go on when it
    exits. ``usage`` says what the tier holds, for the accounting reports.
    """

    def __init__(
        self,
        settings: PoolSettings,
        size_bytes: int,
        labels: Mapping[str, str],
        *,
        fence: Callable[[], AbstractContextManager[Any]] | None = None,
        usage: Callable[[], Usage] | None = None,
    ) -> None:
        self.settings = settings
        self.fence = fence
        self.usage = usage
        self.gone = False  # revoked or lost: the tier is off the pool
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.mappings: list[LeaseMapping] = []
        self.client = PoolClient(settings.socket)
        try:
            self.lease: Lease = self.client.lease(
                round_up(size_bytes, 2 << 20),  # the agent's alignment, and a hugepage
                ttl_s=settings.ttl_s,
                media=settings.media,
                tenant=settings.tenant,
                labels=dict(labels),
                shrinkable=False,  # neither engine can lose slots at run time
                populate=settings.populate,
                hugepages=settings.hugepages,
                numa_node=settings.numa_node,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
        except BaseException:
            self.client.close()
            raise
        self._reporter = threading.Thread(target=self._report_loop, name="pool-tier-report")
        self._reporter.daemon = True

    def map(self, length_bytes: int) -> LeaseMapping:
        """The lease's first ``length_bytes``, faulted in unless the agent already did."""
        mapping = LeaseMapping(self.lease, length_bytes)
        try:
            if not self.lease.populated:
                mapping.populate()
        except BaseException:
            mapping.close()
            raise
        self.mappings.append(mapping)
        return mapping

    def start_reports(self) -> None:
        if self.settings.report_interval_s > 0 and self.usage is not None:
            self._reporter.start()

    # --- what poold asks -------------------------------------------------------------
    def _on_revoke(self, lease: Lease, deadline_at: datetime) -> None:
        log.warning(
            "lease %s revoked (memory goes at %s): moving the engine's tier off the pool",
            lease.lease_id,
            deadline_at.isoformat(),
        )
        self.evacuate(release=True)

    def _on_lost(self, lease: Lease) -> None:
        log.warning("lease %s lost: moving the engine's tier off the pool", lease.lease_id)
        self.evacuate(release=False)

    def evacuate(self, *, release: bool) -> None:
        """Stop the engine's transfers, move every mapping into private memory, then give
        the lease back (revoked) or just close it (lost)."""
        with self._lock:
            if self.gone:
                return
            self.gone = True
        self._stop.set()
        try:
            with self.fence() if self.fence is not None else contextlib.nullcontext():
                for mapping in self.mappings:
                    with mapping.lock:
                        mapping.evacuate()
        except Exception:
            # Still mapped: released all the same, the agent counts the pages against the
            # tenant for as long as they stay mapped and the audit names this process.
            log.exception("lease %s: the tier could not be moved off", self.lease.lease_id)
        if release:
            self.lease.release()
        else:
            with contextlib.suppress(PoolError, OSError):
                self.lease.release()  # closes the fd; the agent already let go

    # --- accounting ------------------------------------------------------------------
    def report(self) -> bool:
        """Send the tier's accounting now; True when the agent took it."""
        if self.gone or self.lease.released or self.usage is None:
            return False
        used, exclusive, replica, exclusive_blocks, replica_blocks = self.usage()
        return self.lease.report(
            used_bytes=used,
            exclusive_bytes=exclusive,
            replica_bytes=replica,
            exclusive_blocks=exclusive_blocks,
            replica_blocks=replica_blocks,
        )

    def _report_loop(self) -> None:
        while not self._stop.wait(self.settings.report_interval_s):
            try:
                self.report()
            except Exception as err:
                log.warning("accounting report for lease %s failed: %s", self.lease.lease_id, err)

    def close(self) -> None:
        """The engine is done with the tier: unmap (or, while a view of it survives, drop
        the lease's pages under it), release, disconnect. Idempotent."""
        self._stop.set()
        with self._lock:
            self.gone = True
        for mapping in self.mappings:
            try:
                mapping.close()
            except BufferError:
                mapping.discard()
        self.lease.release()
        self.client.close()
