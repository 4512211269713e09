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

This module is the transport and the operations (:class:`PoolClient`). A lease in the
tenant's hands is :mod:`agent.lease`, its renewal thread :mod:`agent.renewer`.
``Lease``, ``LostCallback``, ``RevokeCallback``, ``ShrinkCallback``,
``LOST_CONNECTION`` and ``LOST_NOT_HELD`` are re-exported here: import them from
``agent.client`` as before.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

from pydantic import ValidationError

from agent.lease import Lease as Lease
from agent.lease import LostCallback as LostCallback
from agent.lease import RevokeCallback as RevokeCallback
from agent.lease import ShrinkCallback as ShrinkCallback
from agent.paths import client_socket_path
from agent.protocol import (
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
from agent.renewer import Renewer
from agent.session import LOST_CONNECTION as LOST_CONNECTION
from agent.session import LOST_NOT_HELD as LOST_NOT_HELD
from agent.session import Events, Session, close_fds, open_session, resync
from poold.errors import (
    AgentProtocolError,
    AgentUnreachable,
    FrameTooLarge,
    InvalidSize,
    PoolError,
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
        self._renewer = Renewer()
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
        name what is free and where). A ``quota_exceeded`` that only other hosts'
        unspent budgets of the tenant caused (detail ``held_by_budgets``) is tried
        again within the same wait, as poold takes those budgets back. The wait blocks
        this client's other calls.

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

    def _stop_renewing(self, lease_id: str) -> None:
        self._renewer.forget(lease_id)

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
                wanted = timeout_s or self.timeout_s
                if sock.gettimeout() != wanted:  # settimeout is a syscall each time
                    sock.settimeout(wanted)
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
