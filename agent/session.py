"""How does a tenant client hear what its agent pushes while it holds leases?

A connection becomes a tenant session with ``hello`` and ``events``
(:func:`open_session`). From then on a :class:`Session` reader thread takes every frame:
replies go to the caller waiting in :class:`agent.client.PoolClient` (``next_reply``),
events (``revoke``, ``shrink``, ``lost``) to the client's one :class:`Events` thread,
which runs the lease callbacks in order, so a slow callback never stalls a reply. When
the connection drops, that thread runs :func:`resync`: reconnect, ask ``list``, and tell
each lease the agent no longer holds, or that ran out of ttl with no agent to renew it,
that it is lost.

This module knows leases only as :class:`SessionLease`, the few members of
:class:`agent.client.Lease` it calls, so that agent.client can import it.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from agent.protocol import (
    MAX_REPLY_FRAME_BYTES,
    OPERATIONS,
    Event,
    HelloArgs,
    LeaseListing,
    LostEvent,
    RevokeEvent,
    ShrinkEvent,
    encode_request,
    is_event,
    parse_event,
    parse_reply,
    read_frame,
)
from poold.errors import AgentProtocolError, BadRequest, PoolError

log = logging.getLogger(__name__)

_RESYNC_RETRY_S: Final = 0.2
# Why on_lost fired (Lease.lost_reason) when the session's connection dropped; the
# agent's own reasons are agent.protocol LOST_*. Both are re-exported by agent.client.
LOST_CONNECTION: Final = "connection_lost"  # no agent to reconnect to within reconnect_s
LOST_NOT_HELD: Final = "not_held"  # reconnected: the agent no longer holds it


class SessionLease(Protocol):
    """What the session machinery reads and calls of a lease (agent.client.Lease)."""

    lease_id: str
    expires_at: datetime
    lost: bool

    @property
    def released(self) -> bool: ...

    def _revoked(self, deadline_at: datetime) -> None: ...

    def _shrink(self, target_bytes: int, deadline_at: datetime, replica_bytes: int = 0) -> None: ...

    def _lost(self, reason: str, message: str = "") -> None: ...


def close_fds(fds: builtins.list[int]) -> None:
    """Close fds received with a frame that nobody takes, and forget them."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class _Ended:
    """What a session's reader hands a waiting caller once the connection is over."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error  # None: a clean EOF


class _ConnectionLost:
    """A dispatcher item: the session's connection dropped (not by this client)."""


_Reply = tuple[dict[str, Any], builtins.list[int]] | _Ended
_EventItem = RevokeEvent | ShrinkEvent | LostEvent | _ConnectionLost | None


def _expired(lease: SessionLease, now: datetime) -> bool:
    """Has the lease's ttl run out (as its last grant or renewal said)?"""
    expires_at = lease.expires_at
    if expires_at.tzinfo is None:
        expires_at = expires_at.replace(tzinfo=UTC)  # the wire speaks UTC
    return expires_at <= now


class Events:
    """One thread per client running the lease callbacks events bring, in order.

    ``lease_of(lease_id)`` is the client's lease of that id (None: not this client's,
    or released); ``resync()`` runs when the session's connection dropped.
    """

    def __init__(
        self, lease_of: Callable[[str], SessionLease | None], resync: Callable[[], None]
    ) -> None:
        self._lease_of = lease_of
        self._resync = resync
        self._queue: queue.SimpleQueue[_EventItem] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def put(self, item: _EventItem) -> None:
        with self._lock:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="poold-events", daemon=True)
                self._thread.start()
        self._queue.put(item)

    def connection_lost(self) -> None:
        """The session's connection dropped, not by the client's own hand: resync."""
        self.put(_ConnectionLost())

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if isinstance(item, _ConnectionLost):
                    self._resync()
                else:
                    self._deliver(item)
            except Exception:
                log.exception("handling %r failed", item)

    def _deliver(self, event: Event) -> None:
        lease = self._lease_of(event.lease_id)
        if lease is None:
            return  # another client's in this process, or released already
        if isinstance(event, RevokeEvent):
            lease._revoked(event.deadline_at)
        elif isinstance(event, ShrinkEvent):
            lease._shrink(event.target_bytes, event.deadline_at, event.replica_bytes)
        else:
            lease._lost(event.reason, event.message)


class Session:
    """The reader of a connection that is a tenant session: replies and events apart.

    It reads on a dup of the connection's fd, so its socket timeouts are its own and
    closing the client's socket never races its reads; it closes its dup as it ends.
    ``timeout_s()`` is the client's timeout now: how long one frame may take to arrive
    once it has begun.
    """

    def __init__(self, sock: socket.socket, events: Events, timeout_s: Callable[[], float]) -> None:
        self._events = events
        self._timeout_s = timeout_s
        self._sock = socket.socket(fileno=os.dup(sock.fileno()))
        self._replies: queue.SimpleQueue[_Reply] = queue.SimpleQueue()
        self.closing = False  # the client hung up itself: no resync
        self._thread = threading.Thread(target=self._run, name="poold-session", daemon=True)
        self._thread.start()

    def next_reply(self, fds: builtins.list[int], timeout_s: float) -> dict[str, Any] | None:
        """The next reply the reader took (its fds added to ``fds``); None at a clean EOF.

        Raises TimeoutError when none comes in ``timeout_s``, else what ended the
        connection (OSError, or PoolError for a garbled stream), as read_frame would.
        """
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError("no reply in time") from None
        if isinstance(reply, _Ended):
            if reply.error is not None:
                raise reply.error
            return None
        frame, received = reply
        fds.extend(received)
        return frame

    def _run(self) -> None:
        error: BaseException | None = None
        readable = select.poll()
        readable.register(self._sock.fileno(), select.POLLIN)
        try:
            while True:
                readable.poll()  # as long as it takes: a session may be quiet for hours
                fds: builtins.list[int] = []
                try:
                    frame = read_frame(
                        self._sock,
                        max_frame_bytes=MAX_REPLY_FRAME_BYTES,
                        fds=fds,
                        deadline=time.monotonic() + self._timeout_s(),
                    )
                except BaseException:
                    close_fds(fds)
                    raise
                if frame is None:
                    return
                if not is_event(frame):
                    self._replies.put((frame, fds))
                    continue
                close_fds(fds)  # an event never carries memory
                try:
                    event = parse_event(frame)
                except AgentProtocolError as err:
                    log.warning("ignoring a malformed event from the agent: %s", err.message)
                    continue
                if event is not None:
                    self._events.put(event)
        except (OSError, PoolError) as err:
            error = err
        finally:
            self._replies.put(_Ended(error))
            self._sock.close()
            if not self.closing:
                self._events.connection_lost()

    def join(self, timeout_s: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


def open_session(
    sock: socket.socket, events: Events, timeout_s: Callable[[], float]
) -> Session | None:
    """``hello`` with ``events`` on a fresh connection, read here before any reader runs.

    The connection's session; None when the agent does not know the field (protocol 1)
    and refuses it: the connection stays a plain one, and renewals tell what events
    would have. Raises OSError or PoolError when the hello itself fails.
    """
    sock.settimeout(timeout_s())
    sock.sendall(encode_request("hello", HelloArgs(events=True)), socket.MSG_NOSIGNAL)
    fds: builtins.list[int] = []
    try:
        frame = read_frame(sock, max_frame_bytes=MAX_REPLY_FRAME_BYTES, fds=fds)
    finally:
        close_fds(fds)
    if frame is None:
        raise ConnectionResetError("the agent hung up before answering hello")
    try:
        parse_reply(OPERATIONS["hello"], frame)
    except BadRequest as err:
        log.info("the pool agent has no tenant sessions (%s): renewals only", err.message)
        return None
    return Session(sock, events, timeout_s)


def resync(
    leases: Iterable[SessionLease],
    list_held: Callable[[], Sequence[LeaseListing]],
    *,
    reconnect_s: float | None,
    closed: Callable[[], bool],
) -> None:
    """The session's connection dropped: reconnect and ask which leases the agent still
    holds (on the event thread).

    ``list_held`` is the client's ``list``, which reconnects (a session again while
    leases are held). While it fails, a lease is lost (``connection_lost``) once its ttl
    has run out, or all are once ``reconnect_s`` has passed; ``closed()`` ends the
    tries. Once it answers, a lease it does not name is lost (``not_held``), and one it
    names revoked is told so.
    """
    held = [lease for lease in leases if not lease.lost and not lease.released]
    if not held or closed():
        return
    give_up = None if reconnect_s is None else time.monotonic() + reconnect_s
    while True:
        try:
            listing = list_held()
            break
        except PoolError as err:
            if closed():
                return
            out_of_time = give_up is not None and time.monotonic() >= give_up
            now = datetime.now(UTC)
            for lease in held:
                if out_of_time or _expired(lease, now):
                    lease._lost(LOST_CONNECTION, err.message)
            held = [lease for lease in held if not lease.lost and not lease.released]
            if not held:
                return
            time.sleep(_RESYNC_RETRY_S)
    there = {listed.lease_id: listed for listed in listing}
    for lease in held:
        listed = there.get(lease.lease_id)
        if listed is None:
            lease._lost(LOST_NOT_HELD, "the agent does not hold it after reconnecting")
        elif listed.revoke_deadline_at is not None:
            lease._revoked(listed.revoke_deadline_at)
