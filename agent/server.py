"""How does the agent serve its Unix socket to tenant processes?

:class:`AgentServer` accepts connections on a Unix stream socket, learns each peer's
identity from the kernel (``SO_PEERCRED``, never from what a request claims), and
turns frames into calls on a handler object that implements :class:`AgentHandler`
(one method per operation in :data:`agent.protocol.OPERATIONS`, checked at
construction). Replies to operations that carry memory pass the handler's fd with
SCM_RIGHTS.

Threads, not asyncio: one per connection, so that a handler may block (on poold, on a
backend) without stalling other tenants, and fds cross with plain ``sendmsg``. A bad
client costs at most its own connection: errors become error frames.

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
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import errno
import grp
import itertools
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol

from agent.protocol import (
    CRITICAL_EVENTS,
    MAX_FRAME_BYTES,
    OPERATIONS,
    Event,
    HelloArgs,
    HelloResult,
    LeaseArgs,
    LeaseResult,
    ListArgs,
    ListResult,
    Model,
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
    encode_error,
    encode_event,
    encode_result,
    parse_request,
    read_frame,
)
from poold.errors import AgentBusy, FrameTimeout, PoolError

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS: Final = 1024
DEFAULT_MAX_CONNECTIONS_PER_UID: Final = 64
DEFAULT_FRAME_TIMEOUT_S: Final = 10.0
DEFAULT_IDLE_TIMEOUT_S: Final = 300.0
DEFAULT_REPLY_TIMEOUT_S: Final = 30.0
DEFAULT_MAX_QUEUED_EVENTS: Final = 256
# (kind, lease id) pairs a session remembers having queued (revoke/lost go once each).
_TOLD_MEMORY: Final = 4096
_JOIN_TIMEOUT_S: Final = 5.0
_REFUSAL_LOG_INTERVAL_S: Final = 10.0
_REFUSAL_LOG_UIDS: Final = 4096  # uids remembered for that; past it, the table starts over
# struct ucred from <sys/socket.h>: pid_t pid; uid_t uid; gid_t gid.
_UCRED = struct.Struct("iII")
# SO_PEERGROUPS (Linux 4.13) is not exported by Python 3.11's socket module; the value
# is the same on every architecture's asm-generic socket.h.
_SO_PEERGROUPS: Final[int] = getattr(socket, "SO_PEERGROUPS", 59)
# CPython caps getsockopt buffers at 1024 bytes: 256 groups; more falls back to /proc.
_PEERGROUPS_BUFLEN: Final = 1024


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


@dataclass(frozen=True, slots=True)
class Peer:
    """A connected tenant process as the kernel identified it when it connected."""

    connection_id: int
    pid: int
    uid: int
    gid: int
    gids: tuple[int, ...] = ()  # supplementary groups; empty when the kernel would not say
    connected_at: float = field(default_factory=time.time)

    @property
    def all_gids(self) -> tuple[int, ...]:
        """Primary group first, then supplementary ones, without repeats."""
        return tuple(dict.fromkeys((self.gid, *self.gids)))


class AgentHandler(Protocol):
    """What the server calls: one method per operation, plus the end of a connection.

    Methods run on the connection's thread and may block. They raise
    :class:`poold.errors.PoolError` subclasses for failures the tenant can act on;
    anything else is logged and reported as ``internal``. ``lease`` returns the fd to
    pass with its result: the handler keeps owning it (the server sends it, never closes
    it). A reply that cannot be delivered ends the connection, so ``disconnected``
    follows: a lease granted on it then has no holder. A handler may also have
    ``holds_leases(peer) -> bool``: an idle connection for which it says yes stays open;
    ``attach_push(push)``: the server hands it :meth:`AgentServer.push` at start; and
    ``fd_sent(peer, fd)``: called once a reply carrying ``fd`` was sent (or failed to).
    """

    def hello(self, peer: Peer, args: HelloArgs) -> HelloResult: ...

    def lease(self, peer: Peer, args: LeaseArgs) -> tuple[LeaseResult, int]: ...

    def renew(self, peer: Peer, args: RenewArgs) -> RenewResult: ...

    def release(self, peer: Peer, args: ReleaseArgs) -> ReleaseResult: ...

    def shrink(self, peer: Peer, args: ShrinkArgs) -> ShrinkResult: ...

    def list(self, peer: Peer, args: ListArgs) -> ListResult: ...

    def stats(self, peer: Peer, args: StatsArgs) -> StatsResult: ...

    def report(self, peer: Peer, args: ReportArgs) -> ReportResult: ...

    def disconnected(self, peer: Peer) -> None: ...


def bind_handler(
    handler: object,
) -> tuple[dict[str, Callable[[Peer, Model], Any]], Callable[[Peer], None]]:
    """The handler's method per operation and its ``disconnected``; TypeError if any is missing."""
    methods: dict[str, Callable[[Peer, Model], Any]] = {}
    missing: list[str] = []
    for name in OPERATIONS:
        method = getattr(handler, name, None)
        if callable(method):
            methods[name] = method
        else:
            missing.append(name)
    disconnected: Callable[[Peer], None] | None = getattr(handler, "disconnected", None)
    if not callable(disconnected):
        missing.append("disconnected")
    if missing or disconnected is None:
        raise TypeError(
            f"{type(handler).__name__} cannot serve the agent protocol: "
            f"no method for {', '.join(missing)}"
        )
    return methods, disconnected


def read_peer(sock: socket.socket, connection_id: int) -> Peer:
    """The peer's pid/uid/gid (SO_PEERCRED) and supplementary groups, as of connect()."""
    pid, uid, gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return Peer(
        connection_id=connection_id, pid=pid, uid=uid, gid=gid, gids=_peer_groups(sock, pid)
    )


def _peer_groups(sock: socket.socket, pid: int) -> tuple[int, ...]:
    # SO_PEERGROUPS is captured at connect() like SO_PEERCRED, so it cannot race with
    # the pid exiting and being reused; /proc is the fallback for older kernels and for
    # peers with more than 256 groups.
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _PEERGROUPS_BUFLEN)
    except OSError:
        return _proc_groups(pid)
    groups = array.array("I")
    groups.frombytes(raw[: len(raw) - len(raw) % groups.itemsize])
    return tuple(groups)


def _proc_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return tuple(int(gid) for gid in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def _holds_none(peer: Peer) -> bool:
    return False


def _remove_stale_socket(path: Path) -> None:
    """Unlink a socket file nobody listens on; refuse to touch anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            errno.EEXIST, "exists and is not a socket; refusing to replace it", str(path)
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale agent socket %s", path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
    raise OSError(errno.EADDRINUSE, "another agent is already listening", str(path))


def _resolve_gid(group: str | int) -> int:
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise LookupError(f"no such group {group!r} for the agent socket") from None


class _Connection:
    """One accepted socket; ``close`` and ``interrupt`` may race from two threads.

    ``busy`` (a frame begun, or its request running) and ``shed`` are the server's,
    under the server's lock: only a connection that is not busy is ever shed.
    """

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.connection_id = peer.connection_id
        self.thread: threading.Thread | None = None
        self.busy = False
        self.shed = False
        self.last_active = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        # Replies (the connection's thread) and events (its writer) send whole frames.
        self.send_lock = threading.Lock()
        self.wants_events = False  # its hello asked; the session starts once answered
        self.outbox: _Outbox | None = None
        self.writer: threading.Thread | None = None

    def interrupt(self) -> None:
        """Wake the connection's thread out of a blocking recv (it sees EOF)."""
        with self._lock:
            if not self._closed:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.sock.close()


class _Outbox:
    """A session's queued events (see the module docstring for what is kept and dropped)."""

    def __init__(self, bound: int) -> None:
        self._bound = max(1, bound)
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, str, bytes]] = collections.deque()
        self._told: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._closed = False
        self.dropped = 0  # shrink events dropped for room

    def put(self, kind: str, lease_id: str, frame: bytes) -> bool:
        """Queue an event; False when it cannot be (full of critical events: hang up)."""
        with self._cond:
            if self._closed:
                return True
            if kind in CRITICAL_EVENTS:
                key = (kind, lease_id)
                if key in self._told:
                    return True  # said once is enough
                self._told[key] = None
                while len(self._told) > _TOLD_MEMORY:
                    self._told.popitem(last=False)
            else:  # a newer shrink request supersedes the one not yet sent
                for queued in self._queue:
                    if queued[0] == kind and queued[1] == lease_id:
                        self._queue.remove(queued)
                        break
            if len(self._queue) >= self._bound:
                oldest = next((q for q in self._queue if q[0] not in CRITICAL_EVENTS), None)
                if oldest is None:
                    return False
                self._queue.remove(oldest)
                self.dropped += 1
            self._queue.append((kind, lease_id, frame))
            self._cond.notify()
            return True

    def take(self) -> bytes | None:
        """The next frame to send, waiting for one; None once closed."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            return self._queue.popleft()[2]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)


class AgentServer:
    """Serves the agent protocol on a Unix stream socket, one thread per connection.

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
            self._listener = self._bind(self.socket_path, mode, group, backlog)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._lock = threading.Lock()
        self._connections: dict[int, _Connection] = {}
        self._connection_ids = itertools.count(1)
        self._refusals: dict[int, tuple[float, int]] = {}  # uid -> (logged at, refused since)
        self._stopping = threading.Event()
        self._serving_ident: int | None = None  # thread running serve_forever, if any
        self._served = threading.Event()  # serve_forever has returned and cleaned up
        self._closed = False
        attach: Callable[[Callable[[int, int, Event], bool]], None] | None = getattr(
            handler, "attach_push", None
        )
        if callable(attach):
            attach(self.push)

    def _bind(self, path: Path, mode: int, group: str | int | None, backlog: int) -> socket.socket:
        if not path.parent.exists():
            path.parent.mkdir(parents=True)
            # Tenants must traverse it; their access is decided by the socket's own mode.
            os.chmod(path.parent, 0o755)  # noqa: S103  # world-traversable on purpose
        _remove_stale_socket(path)
        gid = None if group is None else _resolve_gid(group)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            # Permissions are set on purpose, before listen(): until then a connect is
            # refused, so nobody slips in under whatever the umask allowed.
            if gid is not None:
                os.chown(path, -1, gid)
            os.chmod(path, mode)
            self._bound_inode = os.stat(path).st_ino
            listener.listen(backlog)
        except BaseException:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return listener

    # --- lifecycle --------------------------------------------------------

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop` or :meth:`shutdown`; then close everything."""
        with self._lock:
            if self._closed or self._serving_ident is not None:
                return
            self._serving_ident = threading.get_ident()
        try:
            poller = select.poll()
            poller.register(self._listener, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            while not self._stopping.is_set():
                events = poller.poll()
                if any(fd == self._wake_r for fd, _ in events):
                    break
                try:
                    sock, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as err:
                    if self._stopping.is_set():
                        break
                    log.error("accept on %s failed: %s", self.socket_path, err)
                    if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        time.sleep(0.1)  # out of fds: let connections close rather than spin
                    continue
                self._admit(sock)
        finally:
            self._close_all()
            self._served.set()

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
        self._listener.close()
        self._unlink_socket()
        for connection in connections:
            connection.interrupt()
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for connection in connections:
            if connection.thread is not None:
                connection.thread.join(max(0.0, deadline - time.monotonic()))
                if connection.thread.is_alive():
                    log.warning("connection %d is still busy at shutdown", connection.connection_id)
        wake_r, wake_w = self._wake_r, self._wake_w
        self._wake_r = self._wake_w = -1
        os.close(wake_r)
        os.close(wake_w)

    def _unlink_socket(self) -> None:
        # Only the file we bound: a newer agent may have replaced it since.
        if self._bound_inode is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(self.socket_path).st_ino == self._bound_inode:
                os.unlink(self.socket_path)

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

    def _start_session(self, connection: _Connection) -> None:
        """The hello asked for events: queue them from now (under the send lock)."""
        outbox = _Outbox(self.limits.max_queued_events)
        writer = threading.Thread(
            target=self._write_events,
            args=(connection, outbox),
            name=f"agent-events-{connection.connection_id}",
            daemon=True,
        )
        connection.writer = writer
        with self._lock:
            connection.outbox = outbox
        writer.start()

    def _write_events(self, connection: _Connection, outbox: _Outbox) -> None:
        """A session's writer: its events, each whole, each within ``reply_timeout_s``."""
        while (frame := outbox.take()) is not None:
            with connection.send_lock:
                delivered = self._send_within(connection.sock, frame, self.limits.reply_timeout_s)
            if not delivered:
                log.info(
                    "connection %d (pid %d uid %d): an event was not delivered (hung up, or "
                    "not read within %.0f s); closing",
                    connection.connection_id,
                    connection.peer.pid,
                    connection.peer.uid,
                    self.limits.reply_timeout_s,
                )
                connection.interrupt()
                return

    @staticmethod
    def _send_within(sock: socket.socket, frame: bytes, timeout_s: float) -> bool:
        """Send all of ``frame`` by ``timeout_s`` from now without blocking past it.

        Its own poll and MSG_DONTWAIT: the socket's timeout is the connection thread's to
        set (it changes with every frame it reads), never the writer's.
        """
        deadline = time.monotonic() + timeout_s
        view = memoryview(frame)
        writable = select.poll()
        writable.register(sock.fileno(), select.POLLOUT)
        try:
            while view:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                ready = writable.poll(left * 1000)
                if not ready:
                    return False
                if ready[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    return False
                try:
                    sent = sock.send(view, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    continue
                view = view[sent:]
        except OSError as err:
            log.debug("event not delivered: %s", err)
            return False
        return True

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
        connection = _Connection(sock, peer)
        limits = self.limits
        refusal: AgentBusy | None = None
        victim: _Connection | None = None
        with self._lock:
            mine = sum(1 for c in self._connections.values() if c.peer.uid == peer.uid)
            if self._closed:
                refusal = AgentBusy("the agent is shutting down")
            elif mine >= limits.max_connections_per_uid:
                refusal = AgentBusy(
                    f"uid {peer.uid} already has {mine} connections to the agent; "
                    "close one or reuse a connection",
                    limit="connections_per_uid",
                    max_connections=limits.max_connections_per_uid,
                )
            elif len(self._connections) >= limits.max_connections:
                victim = self._victim(mine)
                if victim is None:
                    refusal = AgentBusy(
                        f"the agent already serves {limits.max_connections} connections; "
                        "retry later",
                        limit="connections",
                        max_connections=limits.max_connections,
                    )
                else:
                    victim.shed = True
                    del self._connections[victim.connection_id]
            if refusal is None:
                self._connections[connection.connection_id] = connection
        if refusal is not None:
            self._refuse(connection, refusal)
            return
        if victim is not None:
            log.warning(
                "connection cap %d reached: closing idle connection %d of uid %d for uid %d",
                limits.max_connections,
                victim.connection_id,
                victim.peer.uid,
                peer.uid,
            )
            victim.interrupt()
        thread = threading.Thread(
            target=self._serve_connection,
            args=(connection,),
            name=f"agent-conn-{connection.connection_id}",
            daemon=True,
        )
        connection.thread = thread
        thread.start()

    def _victim(self, newcomer_count: int) -> _Connection | None:
        """The connection to shed for a newcomer whose uid has ``newcomer_count`` (under
        the lock): the longest-idle one of the uid with the most connections, if that uid
        has at least two more than the newcomer's and one of them is idle."""
        by_uid: dict[int, list[_Connection]] = collections.defaultdict(list)
        for c in self._connections.values():
            by_uid[c.peer.uid].append(c)
        for conns in sorted(by_uid.values(), key=len, reverse=True):
            if len(conns) <= newcomer_count + 1:
                return None
            idle = [c for c in conns if not c.busy and not c.shed]
            if idle:
                return min(idle, key=lambda c: c.last_active)
        return None

    def _refuse(self, connection: _Connection, busy: AgentBusy) -> None:
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

    def _serve_connection(self, connection: _Connection) -> None:
        peer = connection.peer
        try:
            log.debug(
                "connection %d: pid %d uid %d gid %d",
                peer.connection_id,
                peer.pid,
                peer.uid,
                peer.gid,
            )
            self._converse(connection, peer)
        except OSError as err:
            log.debug("connection %d ended: %s", connection.connection_id, err)
        except Exception:
            log.exception("connection %d failed", connection.connection_id)
        finally:
            with self._lock:
                self._connections.pop(connection.connection_id, None)
            if connection.outbox is not None:
                # The writer must be done with the socket before it closes (its fd
                # number could be reused by another connection).
                connection.interrupt()
                connection.outbox.close()
                if connection.writer is not None:
                    connection.writer.join(_JOIN_TIMEOUT_S)
            connection.close()
            try:
                self._disconnected(peer)
            except Exception:
                log.exception("handler.disconnected failed for connection %d", peer.connection_id)

    def _begin(self, connection: _Connection) -> bool:
        """A frame has begun: the connection may no longer be shed (False: it was)."""
        with self._lock:
            if connection.shed:
                return False
            connection.busy = True
            return True

    def _end(self, connection: _Connection) -> None:
        with self._lock:
            connection.busy = False
            connection.last_active = time.monotonic()

    def _converse(self, connection: _Connection, peer: Peer) -> None:
        sock = connection.sock
        limits = self.limits
        waiting = select.poll()
        waiting.register(sock, select.POLLIN)
        while not self._stopping.is_set():
            if not waiting.poll(limits.idle_timeout_s * 1000):
                if self._holds_leases(peer):
                    continue  # a tenant session: it stays as long as it holds leases
                log.info(
                    "connection %d (pid %d uid %d): idle for %.0f s without leases; closing",
                    peer.connection_id,
                    peer.pid,
                    peer.uid,
                    limits.idle_timeout_s,
                )
                return
            if not self._begin(connection):
                return
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
                return
            except PoolError as err:
                # Oversized or undecodable: the stream can no longer be trusted to be
                # at a frame boundary, so say why and hang up.
                self._hang_up(connection, peer, err)
                return
            if frame is None:
                return
            reply, fd = self._dispatch(connection, frame)
            with connection.send_lock:
                if connection.wants_events and connection.outbox is None:
                    # Events may queue from now; its writer waits for this lock, so the
                    # hello's reply is the first frame the session sees.
                    self._start_session(connection)
                sock.settimeout(limits.reply_timeout_s)  # a peer that never reads pins nothing
                sent = self._send(sock, reply, fd)
                if fd is not None and self._fd_sent is not None:
                    self._fd_sent(peer, fd)  # the kernel has its own reference now
                if not sent:
                    return
            self._end(connection)

    def _hang_up(self, connection: _Connection, peer: Peer, err: PoolError) -> None:
        log.warning(
            "connection %d (pid %d uid %d): %s; closing",
            peer.connection_id,
            peer.pid,
            peer.uid,
            err.message,
        )
        with connection.send_lock:
            connection.sock.settimeout(self.limits.reply_timeout_s)
            self._send(connection.sock, encode_error(err), None)

    def _dispatch(self, connection: _Connection, frame: dict[str, Any]) -> tuple[bytes, int | None]:
        """The reply frame (and fd) for one request; never raises."""
        peer = connection.peer
        op = "?"
        try:
            spec, args = parse_request(frame)
            op = spec.name
            outcome = self._methods[op](peer, args)
            if isinstance(args, HelloArgs) and args.events:
                connection.wants_events = True
            fd: int | None = None
            if spec.carries_fd:
                result, fd = outcome
                if not isinstance(fd, int) or fd < 0:
                    raise TypeError(f"handler.{op} returned {fd!r} instead of an fd")
            else:
                result = outcome
            if not isinstance(result, spec.result_model):
                raise TypeError(
                    f"handler.{op} returned {type(result).__name__}, "
                    f"not {spec.result_model.__name__}"
                )
            return encode_result(result), fd
        except PoolError as err:
            log.info(
                "connection %d (pid %d uid %d) %s: %s %s",
                peer.connection_id,
                peer.pid,
                peer.uid,
                op,
                err.code,
                err.message,
            )
            return encode_error(err), None
        except Exception:
            log.exception(
                "connection %d (pid %d uid %d) %s: internal error",
                peer.connection_id,
                peer.pid,
                peer.uid,
                op,
            )
            internal = PoolError(
                f"internal error in the agent during {op!r}; see the agent's log",
                connection_id=peer.connection_id,
            )
            return encode_error(internal), None

    @staticmethod
    def _send(sock: socket.socket, frame: bytes, fd: int | None) -> bool:
        """Send one frame, with ``fd`` riding on its first byte; False when the peer is gone."""
        try:
            if fd is None:
                sock.sendall(frame, socket.MSG_NOSIGNAL)
            else:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                sent = sock.sendmsg([frame], rights, socket.MSG_NOSIGNAL)
                if sent < len(frame):
                    sock.sendall(frame[sent:], socket.MSG_NOSIGNAL)
        except OSError as err:
            log.debug("reply not delivered: %s", err)
            return False
        return True
