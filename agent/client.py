"""How does a tenant process (an inference engine) get far memory from its host's agent?

Through :class:`PoolClient`::

    with PoolClient() as pool, pool.lease(64 << 30, tenant="llm-a") as lease:
        kv = lease.mmap()          # MAP_SHARED, read/write, lease.length_bytes long
        ...                        # renewed in the background while it is held

One connection per client, opened lazily and shared by all threads (a lock spans each
request and its reply). Leases are renewed by one daemon thread per client at about a
third of their ttl. Failures raise :mod:`poold.errors` exceptions rebuilt from the
agent's reply, so ``err.code`` is the same stable code the agent sent; failing to reach
the agent at all raises :class:`poold.errors.AgentUnreachable`.

While it holds a lease the connection is a tenant session (``hello`` with ``events``):
the agent pushes ``revoke``, ``shrink`` and ``lost`` as soon as it learns them. A
reader thread then takes every frame: replies go to the caller waiting, events to one
callback thread per client (a slow callback never stalls a reply). Renewal replies
still carry revocations and shrink requests; each callback fires once per lease and
event, whichever way it came first. When the session's connection drops, the client
reconnects and asks ``list``: a lease the agent no longer holds is lost (``not_held``).
With no agent to reconnect to, a lease is lost (``connection_lost``) once its ttl has run
out with nobody to renew it, or after ``reconnect_s`` if that is given: an agent that
restarts (systemd does in well under a lease's ttl) re-adopts the leases whose memory is
still mapped, and their holders go on as if nothing happened. The session's reader, its
event thread and the resync are :mod:`agent.session`; this module is the API.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import math
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

from pydantic import ValidationError

from agent.paths import client_socket_path
from agent.protocol import (
    LOST_ENDED,
    LOST_REVOKED,
    MAX_FRAME_BYTES,
    MAX_REPLY_FRAME_BYTES,
    OPERATIONS,
    HelloArgs,
    HelloResult,
    LeaseArgs,
    LeaseListing,
    LeaseResult,
    ListArgs,
    ListResult,
    Model,
    OpSpec,
    ReleaseArgs,
    ReleaseResult,
    RenewArgs,
    RenewResult,
    ReportArgs,
    ReportResult,
    ShrinkArgs,
    ShrinkResult,
    StatsArgs,
    StatsResult,
    encode_request,
    parse_reply,
    read_frame,
    validation_error,
)
from agent.session import LOST_CONNECTION as LOST_CONNECTION
from agent.session import LOST_NOT_HELD as LOST_NOT_HELD
from agent.session import Events, Session, close_fds, open_session, resync
from poold.errors import (
    AgentProtocolError,
    AgentUnreachable,
    FrameTooLarge,
    InvalidSize,
    LeaseNotActive,
    PoolError,
    UnknownLease,
    from_wire,
)
from poold.sizes import parse_size

log = logging.getLogger(__name__)

# Safe to send twice: a reply lost with a dropped connection is simply asked again.
# Not lease (a second grant) nor release/report (not harmful, but not ours to repeat).
_IDEMPOTENT_OPS: Final = frozenset({"hello", "renew", "list", "stats"})
# The agent prefaults a lease before replying (~4 GiB/s measured for memfds); a lease
# reply may take that long on top of the ordinary timeout. 1 GiB/s leaves headroom.
_PREFAULT_BYTES_PER_S: Final = 1 << 30
# Renew at a third of the ttl: two more tries before the lease can expire.
_RENEW_FRACTION: Final = 1 / 3
_MIN_RENEW_RETRY_S: Final = 0.1

# on_shrink(lease, target_bytes, deadline_at): poold asks for memory back (pressure).
# on_revoke(lease, deadline_at): poold revoked the lease; the memory goes at deadline_at.
# on_lost(lease): the lease is over (lease.lost_reason says why).
LostCallback = Callable[["Lease"], None]
RevokeCallback = Callable[["Lease", datetime], None]
ShrinkCallback = Callable[["Lease", int, datetime], None]
_ResultT = TypeVar("_ResultT", bound=Model)
_ArgsT = TypeVar("_ArgsT", bound=Model)


def _size(size: int | str) -> int:
    """A byte count, or a size string by the one rule (poold.sizes): '64GiB', '512M'."""
    if isinstance(size, str):
        try:
            return parse_size(size)
        except ValueError as err:
            raise InvalidSize(str(err), size=size[:64]) from None
    return size


def _args(model: type[_ArgsT], **values: Any) -> _ArgsT:
    """Arguments validated here, failing with the code the agent would send (invalid_size...)."""
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise validation_error(err, "arguments") from None


class Lease:
    """Far memory leased through the agent: an fd to mmap, renewed until released.

    ``release()`` (or leaving the ``with`` block) gives the memory back and closes the
    lease's fd; a second call does nothing. Mappings made with :meth:`mmap` are the
    caller's: close them before releasing. Python's mmap keeps its own duplicate of the
    fd, so an open mapping keeps emulated memory alive after release, while a revoked
    devdax lease is unmapped by the kernel (touching it then raises SIGBUS).

    Callbacks, each at most once per lease and event (see the module docstring for how
    they arrive): ``on_revoke(lease, deadline_at)`` when poold revokes it;
    ``on_shrink(lease, target_bytes, deadline_at)`` under pool pressure, again only when
    the request changes (``shrink_replica_bytes`` says how much of it replicas can give;
    ``KVStore.open`` sets it when it is None); ``on_lost(lease)`` once the lease is over
    and not released: ``lost`` turns True and ``lost_reason`` says why (``revoked``: its
    revocation deadline passed; ``ended``: the ledger ended it, expired or reclaimed;
    ``connection_lost``, ``not_held``: see the module docstring). They run on the
    client's event thread, or on the thread whose renewal brought the news.
    """

    def __init__(
        self,
        client: PoolClient,
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
        self._client._renewer.forget(self.lease_id)
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


class _Renewer:
    """One daemon thread per client renewing every lease it tracks at ~ttl/3."""

    def __init__(self, client: PoolClient) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._leases: dict[str, Lease] = {}
        self._due_at: dict[str, float] = {}  # lease_id -> time.monotonic() of next renewal
        self._thread: threading.Thread | None = None
        self._stopped = False

    def track(self, lease: Lease) -> None:
        with self._cond:
            if self._stopped:
                return
            self._leases[lease.lease_id] = lease
            self._due_at[lease.lease_id] = time.monotonic() + lease.ttl_s * _RENEW_FRACTION
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="poold-lease-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def forget(self, lease_id: str) -> None:
        with self._cond:
            self._leases.pop(lease_id, None)
            self._due_at.pop(lease_id, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                due: list[Lease] = []
                while not self._stopped:
                    now = time.monotonic()
                    due = [self._leases[i] for i, at in self._due_at.items() if at <= now]
                    if due:
                        break
                    next_at = min(self._due_at.values(), default=math.inf)
                    self._cond.wait(None if next_at == math.inf else next_at - now)
                if self._stopped:
                    return
                for lease in due:  # in flight: not due again until rescheduled
                    del self._due_at[lease.lease_id]
            for lease in due:
                self._renew(lease)

    def _renew(self, lease: Lease) -> None:
        interval_s = lease.ttl_s * _RENEW_FRACTION
        try:
            lease.renew()
        except (LeaseNotActive, UnknownLease) as err:
            self.forget(lease.lease_id)
            lease._mark_lost(err)
            return
        except Exception as err:
            # Agent restarting, poold unreachable...: try again well before expiry.
            log.warning("renewing lease %s failed, retrying: %s", lease.lease_id, err)
            interval_s = max(_MIN_RENEW_RETRY_S, interval_s / 3)
        with self._cond:
            if lease.lease_id in self._leases and not self._stopped:
                self._due_at[lease.lease_id] = time.monotonic() + interval_s
                self._cond.notify()


class PoolClient:
    """A tenant's connection to its host's pool agent; thread-safe.

    ``socket_path`` defaults to ``$POOLD_AGENT_SOCKET``, then the host agent's socket
    (see :mod:`agent.paths`). ``timeout_s`` bounds each request; a lease request gets
    extra time in proportion to its size, since the agent prefaults before replying.
    ``close()`` (or leaving the ``with`` block) releases every lease still held.

    ``events`` (default on): hold a tenant session while leases are held (see the
    module docstring); off, the client learns of revocations and shrink requests only
    from renewals, as agents before protocol 2 tell it. ``reconnect_s``: how long a
    dropped session tries to reach the agent again before its leases are lost; by
    default, until each lease expires (the agent may come back and re-adopt it).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout_s: float = 30.0,
        events: bool = True,
        reconnect_s: float | None = None,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()
        self.timeout_s = timeout_s
        self.events = events
        self.reconnect_s = reconnect_s
        self._lock = threading.Lock()  # one request/reply at a time on the connection
        self._sock: socket.socket | None = None
        self._session: Session | None = None  # the connection's reader, once a session
        self._closed = False
        self._leases_lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._renewer = _Renewer(self)
        self._events = Events(self._held, self._resync)

    # --- operations -------------------------------------------------------

    def hello(
        self, client_name: str | None = None, client_version: str | None = None
    ) -> HelloResult:
        """The agent's version and host, and who the agent thinks we are."""
        args = _args(HelloArgs, client_name=client_name, client_version=client_version)
        return self._call(OPERATIONS["hello"], args, HelloResult)[0]

    def lease(
        self,
        size_bytes: int | str,
        ttl_s: int = 60,
        media: str | None = None,
        tenant: str | None = None,
        labels: Mapping[str, str] | None = None,
        renew: bool = True,
        on_lost: Callable[[Lease], None] | None = None,
        on_shrink: ShrinkCallback | None = None,
        on_revoke: RevokeCallback | None = None,
        wait_s: float = 0,
        shrinkable: bool = False,
        populate: bool = False,
        hugepages: str | None = None,
        numa_node: int | None = None,
    ) -> Lease:
        """Lease ``size_bytes`` of far memory; renewed in the background unless ``renew=False``.

        ``size_bytes`` is a byte count or a size string: ``lease("64GiB")`` (``G`` and
        ``GiB`` are binary, ``GB`` decimal; poold.sizes has the rule).

        When the pool is full, ``wait_s`` > 0 waits up to that long (at most 300 s) for
        capacity that pressure frees, served in arrival order on the agent; past it, or
        at once with ``wait_s=0``, the request fails with ``no_capacity`` (its details
        name what is free and where). The wait blocks this client's other calls.

        ``on_revoke(lease, deadline_at)`` is called once when poold revokes the lease
        (admin revoke, device drain): the engine should stop using the memory before
        ``deadline_at``, when the agent takes it back.

        ``shrinkable=True`` (memfd-backed leases) lets the holder give memory back in
        place with :meth:`Lease.shrink`, as the KV store does under pool pressure.

        Pin-ready leases (for ``cudaHostRegister`` / ``ibv_reg_mr``): ``populate=True``
        has every page faulted in before the reply (``lease.populated`` says it was),
        ``hugepages`` ``"off"|"prefer"|"required"`` asks for 2 MiB pages
        (``lease.page_size_bytes`` says what was got), ``numa_node`` the node the memory
        must be on (``lease.numa_node``).

        Never retried: a dropped connection mid-request may have granted a lease whose
        fd was lost; the agent sees the disconnect and poold reclaims it.
        """
        size_bytes = _size(size_bytes)
        args = _args(
            LeaseArgs,
            size_bytes=size_bytes,
            ttl_s=ttl_s,
            media=media,
            tenant=tenant,
            labels=dict(labels or {}),
            wait_s=wait_s,
            shrinkable=shrinkable,
            populate=populate,
            hugepages=hugepages,
            numa_node=numa_node,
        )
        timeout_s = self.timeout_s + size_bytes / _PREFAULT_BYTES_PER_S + args.wait_s
        granted, fd = self._call(OPERATIONS["lease"], args, LeaseResult, timeout_s=timeout_s)
        if fd is None:  # _call guarantees one for carries_fd operations
            raise AgentProtocolError("lease reply carried no fd")
        lease = Lease(self, granted, fd, on_lost, on_shrink, on_revoke)
        lease.tenant = tenant
        lease.labels = dict(args.labels)
        with self._leases_lock:
            self._leases[lease.lease_id] = lease
        if renew:
            self._renewer.track(lease)
        self._open_session()
        return lease

    def renew(self, lease_id: str, ttl_s: int | None = None) -> RenewResult:
        """Extend a lease by ``ttl_s`` (default: its current ttl)."""
        return self._call(
            OPERATIONS["renew"], _args(RenewArgs, lease_id=lease_id, ttl_s=ttl_s), RenewResult
        )[0]

    def shrink(self, lease_id: str, size_bytes: int | str) -> ShrinkResult:
        """Shrink by id; prefer :meth:`Lease.shrink`, which also updates the lease."""
        return self._call(
            OPERATIONS["shrink"],
            _args(ShrinkArgs, lease_id=lease_id, size_bytes=_size(size_bytes)),
            ShrinkResult,
        )[0]

    def release(self, lease_id: str) -> ReleaseResult:
        """Release by id. A lease this client holds is let go first, as
        :meth:`Lease.release` does (renewals stop, its fd is closed): otherwise its own
        fd would keep the bytes counted (``released_mapped``) and its renewals would find
        the lease over."""
        held = self._held(lease_id)
        if held is not None and held._claim_release():
            held._let_go()
        return self._release(lease_id)

    def _release(self, lease_id: str) -> ReleaseResult:
        return self._call(
            OPERATIONS["release"], _args(ReleaseArgs, lease_id=lease_id), ReleaseResult
        )[0]

    def list(self) -> builtins.list[LeaseListing]:
        """Leases the agent holds for this process's identity."""
        return self._call(OPERATIONS["list"], ListArgs(), ListResult)[0].leases

    def stats(self) -> StatsResult:
        return self._call(OPERATIONS["stats"], StatsArgs(), StatsResult)[0]

    def report(
        self,
        lease_id: str,
        *,
        used_bytes: int,
        exclusive_bytes: int,
        replica_bytes: int,
        exclusive_blocks: int = 0,
        replica_blocks: int = 0,
    ) -> bool:
        """Exclusive/replica accounting for one lease; True when the agent accepted it."""
        args = _args(
            ReportArgs,
            lease_id=lease_id,
            used_bytes=used_bytes,
            exclusive_bytes=exclusive_bytes,
            replica_bytes=replica_bytes,
            exclusive_blocks=exclusive_blocks,
            replica_blocks=replica_blocks,
        )
        return self._call(OPERATIONS["report"], args, ReportResult)[0].accepted

    @property
    def leases(self) -> builtins.list[Lease]:
        """Leases granted through this client and not yet released."""
        with self._leases_lock:
            return builtins.list(self._leases.values())

    @property
    def in_session(self) -> bool:
        """Whether the connection is a tenant session now (the agent pushes events)."""
        return self._session is not None

    def _held(self, lease_id: str) -> Lease | None:
        with self._leases_lock:
            return self._leases.get(lease_id)

    def _wants_session(self) -> bool:
        if not self.events or self._closed:
            return False
        with self._leases_lock:
            return any(not lease.lost for lease in self._leases.values())

    # --- tenant sessions ---------------------------------------------------

    def _open_session(self) -> None:
        """Make the connection a session now that a lease is held (best effort: when it
        fails, the session is resynced as if it had dropped)."""
        with self._lock:
            if self._sock is None or self._session is not None or not self._wants_session():
                return
            try:
                self._subscribe(self._sock)
            except (OSError, PoolError) as err:
                log.warning("could not open a session with the pool agent: %s", err)
                self._disconnect()
                self._events.connection_lost()

    def _subscribe(self, sock: socket.socket) -> None:
        """Make a fresh connection a session (agent.session.open_session); under ``_lock``.

        An agent without tenant sessions leaves it a plain connection, and ``events``
        off: renewals tell what events would have.
        """
        self._session = open_session(sock, self._events, lambda: self.timeout_s)
        if self._session is None:
            self.events = False

    def _resync(self) -> None:
        """The session's connection dropped: see which leases the agent still holds."""
        resync(self.leases, self.list, reconnect_s=self.reconnect_s, closed=lambda: self._closed)

    # --- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Stop renewing, release every lease still held, disconnect; safe to call twice."""
        self._renewer.stop()
        for lease in self.leases:
            try:
                lease.release()
            except PoolError as err:
                log.warning("releasing lease %s at close failed: %s", lease.lease_id, err)
        with self._lock:
            self._closed = True
            self._disconnect()
        self._events.stop()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _forget(self, lease: Lease) -> None:
        self._renewer.forget(lease.lease_id)
        with self._leases_lock:
            self._leases.pop(lease.lease_id, None)

    # --- transport --------------------------------------------------------

    def _call(
        self,
        spec: OpSpec,
        args: Model,
        result_type: type[_ResultT],
        *,
        timeout_s: float | None = None,
    ) -> tuple[_ResultT, int | None]:
        """One request, one reply (and its fd, for operations that carry one)."""
        request = encode_request(spec.name, args)
        if len(request) - 4 > MAX_FRAME_BYTES:
            raise FrameTooLarge(
                f"{spec.name} request of {len(request)} bytes exceeds the agent's "
                f"{MAX_FRAME_BYTES}-byte cap (too many or too long labels?)"
            )
        with self._lock:
            if self._closed:
                raise AgentUnreachable("this PoolClient is closed")
            for attempt in (1, 2):
                sock = self._connect()
                sock.settimeout(timeout_s or self.timeout_s)
                try:
                    sock.sendall(request, socket.MSG_NOSIGNAL)
                except OSError as err:
                    # The agent read none of it (it restarted, or turned us away): any
                    # operation may be sent again, once, on a fresh connection.
                    refusal = self._pending_error(sock)
                    self._disconnect()
                    if refusal is not None:
                        raise refusal from err
                    if attempt == 1 and not isinstance(err, TimeoutError):
                        continue
                    raise self._unreachable(spec, err) from err
                fds: builtins.list[int] = []
                try:
                    frame = self._read_reply(sock, fds, timeout_s or self.timeout_s)
                except OSError as err:
                    close_fds(fds)
                    self._disconnect()
                    retry = spec.name in _IDEMPOTENT_OPS and not isinstance(err, TimeoutError)
                    if attempt == 1 and retry:
                        continue
                    raise self._unreachable(spec, err) from err
                except PoolError as err:
                    # The reply stream itself is garbled (not an error reply): drop it.
                    close_fds(fds)
                    self._disconnect()
                    raise AgentProtocolError(
                        f"unreadable reply to {spec.name!r}: {err.message}"
                    ) from err
                if frame is None:
                    close_fds(fds)
                    self._disconnect()
                    if attempt == 1 and spec.name in _IDEMPOTENT_OPS:
                        continue
                    raise AgentUnreachable(
                        f"the pool agent closed the connection before answering {spec.name!r}",
                        socket_path=str(self.socket_path),
                    )
                try:
                    return self._take_reply(spec, frame, fds, result_type)
                except BaseException:
                    close_fds(fds)
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _read_reply(
        self, sock: socket.socket, fds: builtins.list[int], timeout_s: float
    ) -> dict[str, Any] | None:
        """The next reply: read here, or handed over by the session's reader. Raises as
        read_frame does (OSError, TimeoutError, PoolError for a garbled stream)."""
        session = self._session
        if session is None:
            return read_frame(sock, max_frame_bytes=MAX_REPLY_FRAME_BYTES, fds=fds)
        return session.next_reply(fds, timeout_s)

    def _take_reply(
        self,
        spec: OpSpec,
        frame: dict[str, Any],
        fds: builtins.list[int],
        result_type: type[_ResultT],
    ) -> tuple[_ResultT, int | None]:
        result = parse_reply(spec, frame)  # raises the agent's error, if it sent one
        if not isinstance(result, result_type):
            raise AgentProtocolError(f"reply to {spec.name!r} is a {type(result).__name__}")
        if not spec.carries_fd:
            close_fds(fds)  # never expected; never leaked
            return result, None
        if len(fds) != 1:
            raise AgentProtocolError(f"reply to {spec.name!r} carried {len(fds)} fds instead of 1")
        return result, fds[0]

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.socket_path))
            except OSError as err:
                sock.close()
                raise AgentUnreachable(
                    f"cannot reach the pool agent at {self.socket_path}: {err.strerror or err}"
                    " (is pool-agent running? set POOLD_AGENT_SOCKET to point elsewhere)",
                    socket_path=str(self.socket_path),
                ) from err
            self._sock = sock
            if self._wants_session():
                # Leases held: the new connection is a session again before anything else.
                try:
                    self._subscribe(sock)
                except PoolError:
                    self._disconnect()
                    raise
                except OSError as err:
                    self._disconnect()
                    raise AgentUnreachable(
                        f"the pool agent at {self.socket_path} did not answer hello: {err}",
                        socket_path=str(self.socket_path),
                    ) from err
        return self._sock

    def _disconnect(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.closing = True
        if self._sock is not None:
            if session is not None:
                with contextlib.suppress(OSError):  # wakes the reader, which then ends
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        if session is not None:
            session.join(self.timeout_s)

    @staticmethod
    def _pending_error(sock: socket.socket) -> PoolError | None:
        """An error frame the agent sent before hanging up (agent_busy), if one is waiting."""
        try:
            sock.setblocking(False)
            frame = read_frame(sock, max_frame_bytes=MAX_FRAME_BYTES)
        except (OSError, PoolError):
            return None
        error = frame.get("error") if frame else None
        if not isinstance(error, dict):
            return None
        return from_wire(str(error.get("code", "internal")), str(error.get("message", "")))

    def _unreachable(self, spec: OpSpec, err: OSError) -> AgentUnreachable:
        if isinstance(err, TimeoutError):
            return AgentUnreachable(
                f"the pool agent at {self.socket_path} did not answer {spec.name!r} in time",
                socket_path=str(self.socket_path),
            )
        return AgentUnreachable(
            f"lost the connection to the pool agent at {self.socket_path} during "
            f"{spec.name!r}: {err.strerror or err}",
            socket_path=str(self.socket_path),
        )
