"""What is a lease in a tenant's hands, and what happens to it as news arrives?

:class:`Lease`: the fd and its mappings, shrink in place, renew, report, release, and
the ``on_revoke`` / ``on_shrink`` / ``on_lost`` callbacks, each fired at most once per
lease and event whichever way the news came (a pushed event or a renewal reply). The
requests themselves go through the :class:`agent.client.PoolClient` that granted it;
:mod:`agent.client` re-exports everything here.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Protocol

from agent.protocol import (
    LOST_ENDED,
    LOST_REVOKED,
    LeaseResult,
    ReleaseResult,
    RenewResult,
    ShrinkResult,
)
from poold.errors import LeaseNotActive, PoolError, UnknownLease

log = logging.getLogger("agent.client")  # it logs as the client it was split from

# on_shrink(lease, target_bytes, deadline_at): poold asks for memory back (pressure).
# on_revoke(lease, deadline_at): poold revoked the lease; the memory goes at deadline_at.
# on_lost(lease): the lease is over (lease.lost_reason says why).
LostCallback = Callable[["Lease"], None]
RevokeCallback = Callable[["Lease", datetime], None]
ShrinkCallback = Callable[["Lease", int, datetime], None]


class LeaseOwner(Protocol):
    """What a lease asks of the client that granted it (agent/client.py `PoolClient`),
    named here so that this module does not import the client that imports it."""

    def renew(self, lease_id: str, ttl_s: int | None = None) -> RenewResult: ...

    def shrink(self, lease_id: str, size_bytes: int | str) -> ShrinkResult: ...

    def report(
        self,
        lease_id: str,
        *,
        used_bytes: int,
        exclusive_bytes: int,
        replica_bytes: int,
        exclusive_blocks: int = 0,
        replica_blocks: int = 0,
    ) -> bool: ...

    def _release(self, lease_id: str) -> ReleaseResult: ...

    def _forget(self, lease: Lease) -> None: ...

    def _stop_renewing(self, lease_id: str) -> None: ...


class Lease:
    """Far memory leased through the agent: an fd to mmap, renewed until released.

    ``release()`` (or leaving the ``with`` block) gives the memory back and closes the
    lease's fd; a second call does nothing. Mappings made with :meth:`mmap` are the
    caller's: close them before releasing. Python's mmap keeps its own duplicate of the
    fd, so an open mapping keeps emulated memory alive after release, while a revoked
    devdax lease is unmapped by the kernel (touching it then raises SIGBUS).

    Callbacks, each at most once per lease and event (see :mod:`agent.client` for how
    they arrive): ``on_revoke(lease, deadline_at)`` when poold revokes it;
    ``on_shrink(lease, target_bytes, deadline_at)`` under pool pressure, again only when
    the request changes (``shrink_replica_bytes`` says how much of it replicas can give;
    ``KVStore.open`` sets it when it is None); ``on_lost(lease)`` once the lease is over
    and not released: ``lost`` turns True and ``lost_reason`` says why (``revoked``: its
    revocation deadline passed; ``ended``: the ledger ended it, expired or reclaimed;
    ``connection_lost``, ``not_held``: see :mod:`agent.client`). They run on the
    client's event thread, or on the thread whose renewal brought the news.
    """

    def __init__(
        self,
        client: LeaseOwner,
        granted: LeaseResult,
        fd: int,
        on_lost: LostCallback | None = None,
        on_shrink: ShrinkCallback | None = None,
        on_revoke: RevokeCallback | None = None,
    ) -> None:
        self._client = client
        self.on_revoke = on_revoke
        self.revoke_deadline_at: datetime | None = None
        self._fd = fd
        self._lock = threading.Lock()
        self._released = False
        self.on_lost = on_lost
        self.on_shrink = on_shrink
        self.lost = False
        self.lost_reason: str | None = None
        self.shrink_replica_bytes = 0  # of the latest shrink request, what replicas can give
        self._shrink_asked: tuple[int, datetime] | None = None  # latest told to on_shrink
        self.lease_id: str = granted.lease_id
        self.size_bytes: int = granted.size_bytes
        self.length_bytes: int = granted.length_bytes
        self.offset_bytes: int = granted.offset_bytes
        self.epoch: int = granted.epoch
        self.media: str = granted.media
        self.backend: str = granted.backend
        self.numa_node: int | None = granted.numa_node
        self.device_uid: str = granted.device_uid
        self.alignment_bytes: int = granted.alignment_bytes
        self.page_size_bytes: int = granted.page_size_bytes
        self.expires_at: datetime = granted.expires_at
        self.ttl_s: int = granted.ttl_s
        self.shrinkable: bool = granted.shrinkable
        self.populated: bool = granted.populated  # every page faulted in (pin-ready)
        # What it was asked with, so a smaller one can be asked alike (KVStore.relet).
        self.tenant: str | None = None
        self.labels: dict[str, str] = {}

    @property
    def fd(self) -> int:
        """The lease's memory; closed by :meth:`release`, so dup() it to keep it past that."""
        if self._released:
            raise LeaseNotActive(f"lease {self.lease_id} was released", lease_id=self.lease_id)
        return self._fd

    @property
    def released(self) -> bool:
        return self._released

    def mmap(self) -> mmap.mmap:
        """A shared read/write mapping of the whole lease (``length_bytes``)."""
        return mmap.mmap(
            self.fd, self.length_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )

    def shrink(self, size_bytes: int | str) -> int:
        """Give back the tail past ``size_bytes`` (rounded up to the alignment); the new length.

        ``size_bytes`` is a byte count or a size string such as ``"32GiB"``.

        Only for leases granted ``shrinkable`` (memfd-backed): the agent cuts the memfd
        down and tells poold, which can then place others on the freed bytes. Every
        mapping of this lease must stop touching past the new length first (SIGBUS);
        :meth:`mmap` maps the new length from now on. A devdax lease cannot be shrunk
        in place (``not_shrinkable``): release it and lease a smaller one.
        """
        shrunk = self._client.shrink(self.lease_id, size_bytes)
        self.length_bytes = shrunk.length_bytes
        self.size_bytes = min(self.size_bytes, shrunk.length_bytes)
        return shrunk.length_bytes

    def renew(self, ttl_s: int | None = None) -> datetime:
        """Extend the lease by ``ttl_s`` (default: its current ttl); the new ``expires_at``."""
        renewed = self._client.renew(self.lease_id, ttl_s)
        self.expires_at = renewed.expires_at
        if ttl_s is not None:
            self.ttl_s = ttl_s
        if renewed.shrink_target_bytes is not None and renewed.shrink_deadline_at is not None:
            self._shrink(renewed.shrink_target_bytes, renewed.shrink_deadline_at)
        if renewed.revoke_deadline_at is not None:
            self._revoked(renewed.revoke_deadline_at)
        return renewed.expires_at

    def _revoked(self, deadline_at: datetime) -> None:
        """poold revoked the lease: tell the engine once, before the memory goes away."""
        with self._lock:
            if self.revoke_deadline_at is not None or self._released or self.lost:
                return
            self.revoke_deadline_at = deadline_at
        log.warning(
            "lease %s revoked: memory goes away at %s", self.lease_id, deadline_at.isoformat()
        )
        callback = self.on_revoke
        if callback is None:
            return
        try:
            callback(self, deadline_at)
        except Exception:
            log.exception("on_revoke callback failed for lease %s", self.lease_id)

    def _shrink(self, target_bytes: int, deadline_at: datetime, replica_bytes: int = 0) -> None:
        with self._lock:
            asked = (target_bytes, deadline_at)
            if self._shrink_asked == asked or self._released or self.lost:
                return  # the same request by the other path
            self._shrink_asked = asked
            self.shrink_replica_bytes = replica_bytes
        log.info(
            "pool pressure: lease %s asked to give back %d bytes by %s",
            self.lease_id,
            target_bytes,
            deadline_at.isoformat(),
        )
        callback = self.on_shrink
        if callback is None:
            return
        try:
            callback(self, target_bytes, deadline_at)
        except Exception:
            log.exception("on_shrink callback failed for lease %s", self.lease_id)

    def report(
        self,
        *,
        used_bytes: int,
        exclusive_bytes: int,
        replica_bytes: int,
        exclusive_blocks: int = 0,
        replica_blocks: int = 0,
    ) -> bool:
        """Tell the agent how much of this lease holds only-copies vs replicas."""
        return self._client.report(
            self.lease_id,
            used_bytes=used_bytes,
            exclusive_bytes=exclusive_bytes,
            replica_bytes=replica_bytes,
            exclusive_blocks=exclusive_blocks,
            replica_blocks=replica_blocks,
        )

    def release(self) -> None:
        """Give the memory back and close the fd; idempotent."""
        if not self._claim_release():
            return
        self._let_go()
        # Already over (expired, revoked, reclaimed): nothing left to give back.
        with contextlib.suppress(LeaseNotActive, UnknownLease):
            self._client._release(self.lease_id)

    def _claim_release(self) -> bool:
        """True for the one caller that releases it (a release is idempotent)."""
        with self._lock:
            first, self._released = not self._released, True
        return first

    def _let_go(self) -> None:
        """Stop renewing and close the fd, before the release is asked: the agent frees
        the bytes only once no process maps or holds the memfd (DESIGN.md "Memory follows
        the pages"); this fd must not be one of them."""
        self._client._forget(self)
        os.close(self._fd)

    def _mark_lost(self, err: PoolError) -> None:
        """A renewal says the lease is over."""
        reason = LOST_REVOKED if self.revoke_deadline_at is not None else LOST_ENDED
        self._lost(reason, f"{err.code}: {err.message}")

    def _lost(self, reason: str, message: str = "") -> None:
        """The lease is over (``reason``: see the class docstring): tell the engine once."""
        with self._lock:
            if self._released or self.lost:
                return
            self.lost = True
            self.lost_reason = reason
        self._client._stop_renewing(self.lease_id)
        log.warning("lease %s lost (%s): %s", self.lease_id, reason, message)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                log.exception("on_lost callback failed for lease %s", self.lease_id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.release()
            return
        try:  # don't let a failed release hide the exception that ended the block
            self.release()
        except PoolError as err:
            log.warning("releasing lease %s failed: %s", self.lease_id, err)

    def __repr__(self) -> str:
        state = "released" if self._released else "lost" if self.lost else "held"
        return (
            f"<Lease {self.lease_id} {self.length_bytes} bytes {self.backend}/{self.media} "
            f"epoch {self.epoch} {state}>"
        )
