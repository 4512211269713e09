"""What does the agent do when the network between it and poold misbehaves?

A small HTTP/1.1 proxy on loopback, for tests: it forwards each request to one
upstream poold, or, by a rule the test sets, answers it with an error without
forwarding it, or forwards it and drops the reply (poold did the work; the agent
never hears). It sees every request, so a test can check what was sent (a request id
repeated on a retry). Raw sockets and one thread per connection: enough for a test,
and nothing between the agent and poold but what the test asks for.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

# pass: forward and return the reply; drop: forward, then close without a reply;
# refuse: close without forwarding (like a poold killed mid-request); or a status code
# (500, 503...) answered by the proxy itself, the request never forwarded.
Action = Literal["pass", "drop", "refuse"] | int


@dataclass
class Seen:
    """One request the proxy received, and what it did with it."""

    method: str
    path: str
    body: bytes
    action: Action = "pass"

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def _read_message(sock: socket.socket, buf: bytearray) -> tuple[bytes, bytes] | None:
    """One HTTP message head and its Content-Length body; None when the peer closed."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(buf) < end + length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    body = bytes(buf[end : end + length])
    del buf[: end + length]
    return head, body


def _closing(head: bytes) -> bytes:
    """``head`` with ``Connection: close``: each request gets a connection of its own."""
    lines = [
        line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:") and line
    ]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


_REASONS = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


class FaultProxy:
    """A proxy to ``127.0.0.1:upstream_port``; ``rule`` picks each request's fate."""

    def __init__(self, upstream_port: int, port: int = 0) -> None:
        self.upstream_port = upstream_port
        self.rule: Callable[[Seen], Action] = lambda _seen: "pass"
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.port = port
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Listen (again, on the same port after a stop) and serve in the background."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = int(listener.getsockname()[1])
        self._listener = listener
        self._stopped.clear()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening: new connections are refused, as to a dead poold."""
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def requests(self, method: str, path: str) -> list[Seen]:
        """The requests seen for one route (exact path), in arrival order."""
        with self._lock:
            return [s for s in self.seen if s.method == method and s.path == path]

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                conn, _addr = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = bytearray()
            while True:
                try:
                    message = _read_message(conn, buf)
                except OSError:
                    return
                if message is None or self._stopped.is_set():
                    return
                head, body = message
                method, path, _version = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                seen = Seen(method, path.split("?", 1)[0], body)
                seen.action = self.rule(seen)
                with self._lock:
                    self.seen.append(seen)
                if seen.action == "refuse":
                    return
                if isinstance(seen.action, int):
                    self._answer(conn, seen.action)
                    return
                reply = self._forward(head, body)
                if seen.action == "drop" or reply is None:
                    return  # poold did it; the caller never hears
                conn.sendall(reply)
                return  # Connection: close was said; the client opens a new one

    def _answer(self, conn: socket.socket, status: int) -> None:
        code = "ledger_unavailable" if status == 503 else "internal"
        body = json.dumps({"code": code, "message": f"injected {status} by the test proxy"})
        data = body.encode()
        conn.sendall(
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + data
        )

    def _forward(self, head: bytes, body: bytes) -> bytes | None:
        try:
            with socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30) as up:
                up.sendall(_closing(head) + body)
                buf = bytearray()
                message = _read_message(up, buf)
        except OSError:
            return None
        if message is None:
            return None
        reply_head, reply_body = message
        return _closing(reply_head) + reply_body
