"""What is one accepted agent connection, and how is one request on it answered?

:class:`Connection` is the socket, its peer and the state the server and its threads
share about it (busy, shed, last active, its session's outbox and writer);
:func:`dispatch` turns one request frame into its reply (and fd) and never raises;
:func:`send_reply` sends a frame with the fd riding on its first byte (SCM_RIGHTS).
The loop that reads frames, and the limits around it, are :mod:`agent.server`'s.
"""

from __future__ import annotations

import array
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from agent import hand_off
from agent.event_writer import Outbox, send_within
from agent.peer import Peer
from agent.protocol import (
    OPERATIONS,
    HelloArgs,
    Model,
    encode_error,
    encode_result,
    parse_request,
)
from poold.errors import PoolError
from poold.logs import RefusalLog

log = logging.getLogger("agent.server")  # it logs as the server it was split from


class Connection:
    """One accepted socket; ``close`` and ``interrupt`` may race from two threads.

    ``busy`` (a frame begun, or its request running) and ``shed`` are the server's,
    under the server's lock: only a connection that is not busy is ever shed.
    """

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.connection_id = peer.connection_id
        self.fd = sock.fileno()  # kept: the server's poll set is keyed by it
        self.busy = False
        self.shed = False
        self.last_active = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        # Replies (the connection's thread) and events (its writer) send whole frames.
        self.send_lock = threading.Lock()
        self.wants_events = False  # its hello asked; the session starts once answered
        self.outbox: Outbox | None = None
        self.writer: threading.Thread | None = None

    def interrupt(self) -> None:
        """Wake whoever reads the connection out of a blocking recv (it sees EOF)."""
        with self._lock:
            if not self._closed:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.sock.close()


def dispatch(
    methods: dict[str, Callable[[Peer, Model], Any]],
    connection: Connection,
    frame: dict[str, Any],
    refusals: RefusalLog,
) -> tuple[bytes, int | None]:
    """The reply frame (and fd) for one request; never raises. A refusal is the tenant's
    to read in its reply; the log has the first of each uid and code, then a summary a
    minute (a tenant looping on one refused at socket speed wrote a line per request)."""
    peer = connection.peer
    # Named only by what the agent knows: the log keys refusals by it (an op a tenant
    # made up is "?", so made-up names are one key, not one line each).
    asked = frame.get("op")
    op = asked if isinstance(asked, str) and asked in OPERATIONS else "?"
    try:
        spec, args = parse_request(frame)
        outcome = methods[op](peer, args)
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
                f"handler.{op} returned {type(result).__name__}, not {spec.result_model.__name__}"
            )
        return encode_result(result), fd
    except PoolError as err:
        refusals.refused(err, f"uid {peer.uid}, {op}")
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


# The socket module's MSG_* flags are enum members, whose ``|`` costs more than a send.
_NOSIGNAL: Final = int(socket.MSG_NOSIGNAL)
_SEND_NOW: Final = _NOSIGNAL | int(socket.MSG_DONTWAIT)


def send_reply(
    sock: socket.socket, frame: bytes, fd: int | None, timeout_s: float | None = None
) -> bool:
    """Send one frame, with ``fd`` riding on its first byte; False when the peer is gone
    (or, with ``timeout_s``, has not taken it all within that many seconds).

    What the socket buffer takes now is sent without waiting (one sendmsg; a timeout on
    the socket would add an ioctl and a poll, each a GIL hand-over); only the rest waits,
    under ``timeout_s``, and the socket is left without a timeout again after."""
    rights: list[tuple[int, int, array.array[int]]] = []
    if fd is not None:
        rights.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd])))
    flags = _NOSIGNAL
    try:
        try:
            sent = sock.sendmsg([frame], rights, _SEND_NOW)
        except BlockingIOError:
            sent = 0
        if sent == len(frame):
            return True
        hand_off.ahead()  # the peer is slow to read: the agent's socket loop goes on
        sock.settimeout(timeout_s)
        try:
            if not sent:  # nothing left yet: the fd rides on the first byte that does
                sent = sock.sendmsg([frame], rights, flags)
            if sent < len(frame):
                sock.sendall(frame[sent:], flags)
        finally:
            sock.settimeout(None)
    except OSError as err:
        log.debug("reply not delivered: %s", err)
        return False
    return True


def write_events(connection: Connection, outbox: Outbox, reply_timeout_s: float) -> None:
    """A session's writer: its events, each whole, each within ``reply_timeout_s``."""
    while (frame := outbox.take()) is not None:
        with connection.send_lock:
            delivered = send_within(connection.sock, frame, reply_timeout_s)
        if not delivered:
            log.info(
                "connection %d (pid %d uid %d): an event was not delivered (hung up, or "
                "not read within %.0f s); closing",
                connection.connection_id,
                connection.peer.pid,
                connection.peer.uid,
                reply_timeout_s,
            )
            connection.interrupt()
            return
