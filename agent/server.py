"""How does the agent serve its Unix socket to tenant processes?

:class:`AgentServer` accepts connections on a Unix stream socket, learns each peer's
identity from the kernel (``SO_PEERCRED``, never from what a request claims), and
turns frames into calls on a handler object that implements :class:`AgentHandler`
(one method per operation in :data:`agent.protocol.OPERATIONS`, checked at
construction). Replies to operations that carry memory pass the handler's fd with
SCM_RIGHTS.

One thread serves every connection, in turn (epoll, each connection armed once per
request): a lease+release passes the GIL to no other thread, where a thread per
connection handed it over at each of its syscalls (at 8 tenants the agent's CPU per
cycle doubled). A request about to wait (a central grant, a frame not all there, a
peer not reading) passes the loop to a new thread first (:mod:`agent.hand_off`) and
finishes on its own; a request slow for a reason nobody marked is caught by a watchdog
within ``hand_off.WATCH_INTERVAL_S`` or two. Threads, not asyncio: a handler may block (on
poold, on a backend), and fds cross with plain ``sendmsg``. A bad client costs at most
its own connection: errors become error frames.

Anyone in the socket's group can connect, so everything a connection can pin is
bounded (:class:`SocketLimits`): connections per uid well below the global cap; a
frame must arrive whole within ``frame_timeout_s`` of its first byte and within
``max_frame_bytes``; a reply the peer does not read is given up after
``reply_timeout_s``; a connection idle for ``idle_timeout_s`` is closed unless its
process holds leases (a tenant session stays). When the global cap is reached, a
newcomer takes the place of the longest-idle connection of the uid holding the most
connections, if that uid holds at least two more than the newcomer's: one uid (or a
few) flooding the socket cannot keep any other uid out. Fds a peer attaches are
never received (the kernel closes them).

Tenant sessions (a ``hello`` that asked ``events``): :meth:`AgentServer.push` queues an
event for a lease's holder and returns at once, whatever thread calls it (the heartbeat
thread does); the session's own writer thread sends it, between replies (one send lock
per connection keeps frames whole). The queue is bounded (``max_queued_events``):
revoke and lost are queued once per lease, a newer shrink replaces an older one of the
same lease, and a full queue drops its oldest shrink; a queue full of revokes and losts
(a tenant that does not read) is hung up on, like a reply not read within
``reply_timeout_s``. Its leases stay (a process may reconnect); the client resyncs
with ``list``.

This module accepts connections, bounds them per uid and runs each one's read loop;
the pieces it uses answer their own questions: :mod:`agent.peer` (who is connected),
:mod:`agent.handler` (what a handler implements), :mod:`agent.connection` (one
connection, one request's reply and fd), :mod:`agent.event_writer` (a session's queued
events and their writer), :mod:`agent.socket_file` (the socket file). ``Peer``,
``read_peer``, ``AgentHandler`` and ``bind_handler`` are still importable from here.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final

from agent import after_reply, hand_off
from agent.connection import Connection, dispatch, send_reply, write_events
from agent.event_writer import Outbox
from agent.handler import AgentHandler as AgentHandler
from agent.handler import bind_handler as bind_handler
from agent.peer import Peer as Peer
from agent.peer import read_peer as read_peer
from agent.protocol import MAX_FRAME_BYTES, Event, encode_error, encode_event, read_frame
from agent.socket_file import bind_listener, unlink_listener
from poold.errors import AgentBusy, FrameTimeout, PoolError
from poold.logs import RefusalLog

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS: Final = 1024
DEFAULT_MAX_CONNECTIONS_PER_UID: Final = 64
DEFAULT_FRAME_TIMEOUT_S: Final = 10.0
DEFAULT_IDLE_TIMEOUT_S: Final = 300.0
DEFAULT_REPLY_TIMEOUT_S: Final = 30.0
DEFAULT_MAX_QUEUED_EVENTS: Final = 256
_JOIN_TIMEOUT_S: Final = 5.0
_ARMED: Final = select.EPOLLIN | select.EPOLLONESHOT
_ACCEPTS_PER_ROUND: Final = 64  # a flood of connects does not starve the requests
_REFUSAL_LOG_INTERVAL_S: Final = 10.0
_REFUSAL_LOG_UIDS: Final = 4096  # uids remembered for that; past it, the table starts over


@dataclass(frozen=True, slots=True)
class SocketLimits:
    """What one connection, and one uid, may hold of the agent (see the module docstring)."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_uid: int = DEFAULT_MAX_CONNECTIONS_PER_UID
    frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_queued_events: int = DEFAULT_MAX_QUEUED_EVENTS  # per tenant session


def _holds_none(peer: Peer) -> bool:
    return False


class AgentServer:
    """Serves the agent protocol on a Unix stream socket, one loop for every connection.

    Binding happens in the constructor, so a bad path, a live agent already on it or an
    incomplete handler fails at start. ``serve_forever`` runs the accept loop;
    ``shutdown`` stops it, closes every connection and joins their threads.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None,
        handler: AgentHandler,
        *,
        mode: int = 0o660,
        group: str | int | None = None,
        listen_socket: socket.socket | None = None,
        max_connections: int | None = None,
        backlog: int = 128,
        limits: SocketLimits | None = None,
    ) -> None:
        self._methods, self._disconnected = bind_handler(handler)
        self._refusal_log = RefusalLog(log)  # tenants' refused requests, summarised
        holds: Callable[[Peer], bool] | None = getattr(handler, "holds_leases", None)
        self._holds_leases: Callable[[Peer], bool] = holds if callable(holds) else _holds_none
        sent: Callable[[Peer, int], None] | None = getattr(handler, "fd_sent", None)
        self._fd_sent: Callable[[Peer, int], None] | None = sent if callable(sent) else None
        limits = limits or SocketLimits()
        if max_connections is not None:
            limits = dataclasses.replace(limits, max_connections=max_connections)
        self.limits = limits
        self.max_connections = limits.max_connections
        self._bound_inode: int | None = None
        if listen_socket is not None:
            # Adopted (systemd socket activation): its unit set path and permissions.
            if listen_socket.family != socket.AF_UNIX or listen_socket.type != socket.SOCK_STREAM:
                raise ValueError("the adopted listen socket must be an AF_UNIX stream socket")
            self._listener = listen_socket
            self.socket_path = Path(socket_path or listen_socket.getsockname())
        else:
            if socket_path is None:
                raise ValueError("AgentServer needs a socket path or a listening socket")
            self.socket_path = Path(socket_path)
            self._listener, self._bound_inode = bind_listener(
                self.socket_path, mode, group, backlog
            )
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._lock = threading.Lock()
        self._connections: dict[int, Connection] = {}
        self._connection_ids = itertools.count(1)
        self._refusals: dict[int, tuple[float, int]] = {}  # uid -> (logged at, refused since)
        self._stopping = threading.Event()
        self._epoll = select.epoll()
        self._by_fd: dict[int, Connection] = {}  # armed or being served; under the lock
        self._turns = hand_off.Turns(self._run, self._stopping)  # who runs the loop now
        self._serving_ident: int | None = None  # thread running serve_forever, if any
        self._served = threading.Event()  # serve_forever has returned and cleaned up
        self._closed = False
        attach: Callable[[Callable[[int, int, Event], bool]], None] | None = getattr(
            handler, "attach_push", None
        )
        if callable(attach):
            attach(self.push)

    # --- lifecycle --------------------------------------------------------

    def serve_forever(self) -> None:
        """Accept and serve connections until :meth:`stop` or :meth:`shutdown`; then close
        everything. The loop runs in threads of its own, one at a time (a signal handler
        calling :meth:`stop` needs this thread free); this one waits for the stop."""
        with self._lock:
            if self._closed or self._serving_ident is not None:
                return
            self._serving_ident = threading.get_ident()
        try:
            self._epoll.register(self._listener.fileno(), select.EPOLLIN)
            self._epoll.register(self._wake_r, select.EPOLLIN)
            self._turns.begin()
            self._stopping.wait()
        finally:
            self._close_all()
            self._served.set()

    def _run(self, turn: hand_off.Turn) -> None:
        """Poll and serve while this thread has ``turn``."""
        listener_fd = self._listener.fileno()
        sweep_every = min(1.0, max(hand_off.WATCH_INTERVAL_S, self.limits.idle_timeout_s / 4))
        sweep_at = time.monotonic() + sweep_every
        while self._turns.current is turn and not self._stopping.is_set():
            try:
                # One event a poll: a request that hands the loop on mid-way leaves no
                # other connection disarmed behind it (each is armed for one event).
                events = self._epoll.poll(max(0.0, sweep_at - time.monotonic()), 1)
            except (OSError, ValueError):  # closed under us: shutting down
                return
            if events:
                ((fd, _),) = events
                if fd == self._wake_r:
                    return
                if fd == listener_fd:
                    self._accept()
                elif (connection := self._by_fd.get(fd)) is not None and not self._serve(
                    connection, turn
                ):
                    return
            if time.monotonic() >= sweep_at:
                self._sweep()
                sweep_at = time.monotonic() + sweep_every

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if self._stopping.is_set():
                    return
                log.error("accept on %s failed: %s", self.socket_path, err)
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.1)  # out of fds: let connections close rather than spin
                return
            self._admit(sock)

    def start_in_thread(self) -> threading.Thread:
        """Run :meth:`serve_forever` on a daemon thread (tests, embedding)."""
        thread = threading.Thread(target=self.serve_forever, name="agent-accept", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Ask serve_forever to return (it then closes everything). Safe in a signal handler."""
        self._stopping.set()
        wake_w = self._wake_w
        if wake_w >= 0:
            with contextlib.suppress(OSError):  # full pipe: a wake-up is already pending
                os.write(wake_w, b"x")

    def shutdown(self) -> None:
        """Stop accepting, close every connection, join their threads; safe to call twice.

        From the thread inside serve_forever (a signal handler), it only stops the loop;
        serve_forever does the rest as it returns.
        """
        self.stop()
        serving_ident = self._serving_ident
        if serving_ident == threading.get_ident():
            return
        if serving_ident is not None and not self._served.wait(_JOIN_TIMEOUT_S):
            log.warning("the accept loop did not stop within %.0f s", _JOIN_TIMEOUT_S)
        self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections.values())
        threads = self._turns.close()
        self._listener.close()
        # Only the file we bound: a newer agent may have replaced it since.
        unlink_listener(self.socket_path, self._bound_inode)
        for connection in connections:
            connection.interrupt()
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("a request was still being served at shutdown (%s)", thread.name)
        with self._lock:
            left = list(self._by_fd.values())
        for connection in left:
            self._drop(connection)
        self._epoll.close()
        wake_r, wake_w = self._wake_r, self._wake_w
        self._wake_r = self._wake_w = -1
        os.close(wake_r)
        os.close(wake_w)

    def __enter__(self) -> AgentServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    @property
    def connection_count(self) -> int:
        with self._lock:
            return len(self._connections)

    # --- tenant sessions --------------------------------------------------

    def push(self, connection_id: int, pid: int, event: Event) -> bool:
        """Queue ``event`` for a lease's holder; never blocks. True when a session took it.

        It goes to the connection that leased it (``connection_id``) if that is a session;
        otherwise to every session of the holder's process (``pid``: it reconnected, or
        leased on a connection that never asked for events). A client ignores events of
        leases it does not hold.
        """
        frame = encode_event(event)
        with self._lock:
            own = self._connections.get(connection_id)
            if own is not None and own.outbox is not None:
                targets = [own]
            else:
                targets = [
                    c
                    for c in self._connections.values()
                    if c.outbox is not None and c.peer.pid == pid
                ]
        queued = False
        for target in targets:
            outbox = target.outbox
            if outbox is None:
                continue
            if outbox.put(event.event, event.lease_id, frame):
                queued = True
                continue
            log.warning(
                "connection %d (pid %d uid %d): %d events unread; closing the session",
                target.connection_id,
                target.peer.pid,
                target.peer.uid,
                len(outbox),
            )
            target.interrupt()
        return queued

    def sessions(self) -> int:
        """How many connections are tenant sessions now."""
        with self._lock:
            return sum(1 for c in self._connections.values() if c.outbox is not None)

    def _start_session(self, connection: Connection) -> None:
        """The hello asked for events: queue them from now (under the send lock)."""
        outbox = Outbox(self.limits.max_queued_events)
        writer = threading.Thread(
            target=write_events,
            args=(connection, outbox, self.limits.reply_timeout_s),
            name=f"agent-events-{connection.connection_id}",
            daemon=True,
        )
        connection.writer = writer
        with self._lock:
            connection.outbox = outbox
        writer.start()

    # --- connections ------------------------------------------------------

    def connections_of(self, uid: int) -> int:
        """How many connections of ``uid`` are open now."""
        with self._lock:
            return sum(1 for c in self._connections.values() if c.peer.uid == uid)

    def _admit(self, sock: socket.socket) -> None:
        connection_id = next(self._connection_ids)
        try:
            peer = read_peer(sock, connection_id)
        except OSError as err:  # gone already
            log.debug("connection %d: no peer credentials: %s", connection_id, err)
            sock.close()
            return
        sock.setblocking(True)
        connection = Connection(sock, peer)
        refusal, victim = self._place(connection)
        if refusal is not None and not self._closed and self._reap_hung_up():
            # Connections already closed by their peers (a burst, opened and dropped
            # before the loop read their EOF) count for nobody.
            refusal, victim = self._place(connection)
        if refusal is not None:
            self._refuse(connection, refusal)
            return
        if victim is not None:
            log.warning(
                "connection cap %d reached: closing idle connection %d of uid %d for uid %d",
                self.limits.max_connections,
                victim.connection_id,
                victim.peer.uid,
                peer.uid,
            )
            victim.interrupt()
        log.debug(
            "connection %d: pid %d uid %d gid %d", peer.connection_id, peer.pid, peer.uid, peer.gid
        )
        with self._lock:
            self._by_fd[connection.fd] = connection
        self._epoll.register(connection.fd, _ARMED)

    def _place(self, connection: Connection) -> tuple[AgentBusy | None, Connection | None]:
        """Take ``connection`` in, or say why not; the connection it displaces, if any."""
        limits = self.limits
        uid = connection.peer.uid
        with self._lock:
            mine = sum(1 for c in self._connections.values() if c.peer.uid == uid)
            if self._closed:
                return AgentBusy("the agent is shutting down"), None
            if mine >= limits.max_connections_per_uid:
                return AgentBusy(
                    f"uid {uid} already has {mine} connections to the agent; "
                    "close one or reuse a connection",
                    limit="connections_per_uid",
                    max_connections=limits.max_connections_per_uid,
                ), None
            victim: Connection | None = None
            if len(self._connections) >= limits.max_connections:
                victim = self._victim(mine)
                if victim is None:
                    return AgentBusy(
                        f"the agent already serves {limits.max_connections} connections; "
                        "retry later",
                        limit="connections",
                        max_connections=limits.max_connections,
                    ), None
                victim.shed = True
                del self._connections[victim.connection_id]
            self._connections[connection.connection_id] = connection
            return None, victim

    def _reap_hung_up(self) -> bool:
        """Close the idle connections whose peers have hung up; True if there were any."""
        with self._lock:
            idle = [c for c in self._by_fd.values() if not c.busy and not c.shed]
        hangups = select.poll()
        for connection in idle:
            hangups.register(connection.fd, 0)  # POLLHUP and POLLERR are always reported
        gone = {fd for fd, _ in hangups.poll(0)}
        reaped = False
        for connection in idle:
            if connection.fd in gone and self._shed(connection):
                self._drop(connection)
                reaped = True
        return reaped

    def _shed(self, connection: Connection) -> bool:
        """Mark an idle connection for closing; False when a request began on it meanwhile
        (or another thread shed it first)."""
        with self._lock:
            if connection.busy or connection.shed:
                return False
            connection.shed = True
            return True

    def _arm(self, fd: int) -> None:
        """Poll ``fd`` again (for one request)."""
        with contextlib.suppress(OSError, ValueError):  # gone, or shutting down
            self._epoll.modify(fd, _ARMED)

    def _victim(self, newcomer_count: int) -> Connection | None:
        """The connection to shed for a newcomer whose uid has ``newcomer_count`` (under
        the lock): the longest-idle one of the uid with the most connections, if that uid
        has at least two more than the newcomer's and one of them is idle."""
        by_uid: dict[int, list[Connection]] = collections.defaultdict(list)
        for c in self._connections.values():
            by_uid[c.peer.uid].append(c)
        for conns in sorted(by_uid.values(), key=len, reverse=True):
            if len(conns) <= newcomer_count + 1:
                return None
            idle = [c for c in conns if not c.busy and not c.shed]
            if idle:
                return min(idle, key=lambda c: c.last_active)
        return None

    def _refuse(self, connection: Connection, busy: AgentBusy) -> None:
        peer = connection.peer
        # One line per uid per interval: a flood of refusals must not become a flood of log.
        now = time.monotonic()
        since, unlogged = self._refusals.get(peer.uid, (0.0, 0))
        if now - since >= _REFUSAL_LOG_INTERVAL_S:
            more = f" (and {unlogged} more refused since)" if unlogged else ""
            log.warning(
                "refusing connection of uid %d pid %d: %s%s", peer.uid, peer.pid, busy.message, more
            )
            self._refusals[peer.uid] = (now, 0)
            if len(self._refusals) > _REFUSAL_LOG_UIDS:
                self._refusals = {peer.uid: (now, 0)}
        else:
            self._refusals[peer.uid] = (since, unlogged + 1)
        with contextlib.suppress(OSError):
            # Never block the accept loop on a peer that does not read.
            connection.sock.send(encode_error(busy), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        connection.close()

    def _serve(self, connection: Connection, turn: hand_off.Turn) -> bool:
        """One request on ``connection``; True while this thread still has the loop."""
        turn.since = time.monotonic()
        try:
            with hand_off.serving(lambda: self._turns.hand_off(turn)):
                keep = False
                try:
                    keep = self._converse_once(connection)
                except OSError as err:
                    log.debug("connection %d ended: %s", connection.connection_id, err)
                except Exception:
                    log.exception("connection %d failed", connection.connection_id)
                if keep:
                    self._arm(connection.fd)
                else:
                    self._drop(connection)
        finally:
            turn.since = 0.0
        return self._turns.current is turn

    def _drop(self, connection: Connection) -> None:
        """Close ``connection`` and tell the handler; once, whichever thread asks."""
        with self._lock:
            if self._by_fd.get(connection.fd) is not connection:
                return
            del self._by_fd[connection.fd]
            self._connections.pop(connection.connection_id, None)
        # Out of the poll set before the fd is closed (its number may be reused at once).
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(connection.fd)
        if connection.outbox is not None:
            # The writer must be done with the socket before it closes (its fd number
            # could be reused by another connection).
            connection.interrupt()
            connection.outbox.close()
            if connection.writer is not None and connection.writer.is_alive():
                hand_off.ahead()
                connection.writer.join(_JOIN_TIMEOUT_S)
        connection.close()
        try:
            self._disconnected(connection.peer)
        except Exception:
            log.exception("handler.disconnected failed for connection %d", connection.connection_id)

    def _sweep(self) -> None:
        """Close the connections idle for ``idle_timeout_s`` whose process holds no lease
        (a tenant session stays as long as it holds leases)."""
        idle_s = self.limits.idle_timeout_s
        now = time.monotonic()
        with self._lock:
            idle = [
                c
                for c in self._connections.values()
                if not c.busy and not c.shed and now - c.last_active >= idle_s
            ]
        for connection in idle:
            peer = connection.peer
            if self._holds_leases(peer):
                connection.last_active = now  # asked again after another idle period
                continue
            if not self._shed(connection):
                continue
            log.info(
                "connection %d (pid %d uid %d): idle for %.0f s without leases; closing",
                peer.connection_id,
                peer.pid,
                peer.uid,
                idle_s,
            )
            self._drop(connection)

    def _begin(self, connection: Connection) -> bool:
        """A frame has begun: the connection may no longer be shed (False: it was)."""
        with self._lock:
            if connection.shed:
                return False
            connection.busy = True
            return True

    def _end(self, connection: Connection) -> None:
        with self._lock:
            connection.busy = False
            connection.last_active = time.monotonic()

    def _converse_once(self, connection: Connection) -> bool:
        """Read one request, answer it; False when the connection is to close."""
        sock = connection.sock
        peer = connection.peer
        limits = self.limits
        if not self._begin(connection):
            return False
        try:
            frame = read_frame(
                sock,
                max_frame_bytes=limits.max_frame_bytes,
                deadline=time.monotonic() + limits.frame_timeout_s,
            )
        except TimeoutError:
            self._hang_up(
                connection,
                peer,
                FrameTimeout(
                    f"a frame was begun and not finished within {limits.frame_timeout_s:g} s",
                    timeout_s=limits.frame_timeout_s,
                ),
            )
            return False
        except PoolError as err:
            # Oversized or undecodable: the stream can no longer be trusted to be at a
            # frame boundary, so say why and hang up.
            self._hang_up(connection, peer, err)
            return False
        if frame is None:
            return False
        if sock.gettimeout() is not None:  # the frame was waited for: no timeout again
            sock.settimeout(None)
        # What the handler left until after its reply runs as this block ends.
        with after_reply.serving():
            reply, fd = dispatch(self._methods, connection, frame, self._refusal_log)
            try:
                with _Sending(connection):
                    if connection.wants_events and connection.outbox is None:
                        # Events may queue from now; its writer waits for this lock, so
                        # the hello's reply is the first frame the session sees.
                        self._start_session(connection)
                    # A peer that never reads pins nothing: bounded by the reply timeout.
                    sent = send_reply(sock, reply, fd, limits.reply_timeout_s)
            finally:
                if fd is not None and self._fd_sent is not None:
                    self._fd_sent(peer, fd)  # sent: the kernel has its own reference now
            if not sent:
                return False
        self._end(connection)
        return not self._stopping.is_set()

    def _hang_up(self, connection: Connection, peer: Peer, err: PoolError) -> None:
        log.warning(
            "connection %d (pid %d uid %d): %s; closing",
            peer.connection_id,
            peer.pid,
            peer.uid,
            err.message,
        )
        with _Sending(connection):
            send_reply(connection.sock, encode_error(err), None, self.limits.reply_timeout_s)


class _Sending:
    """Hold the connection's send lock; when its session's writer has it (an event to a
    slow reader), the loop goes on without this thread first. (A class, not
    @contextmanager: entered on every reply.)"""

    __slots__ = ("_lock",)

    def __init__(self, connection: Connection) -> None:
        self._lock = connection.send_lock

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            hand_off.ahead()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
