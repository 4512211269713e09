"""agent.hand_off through a real AgentServer: one request that waits never stalls the rest.

The server serves every connection from one thread at a time; these tests hold one
request inside its handler (marked with ``hand_off.ahead`` or not) or leave a frame half
sent, and time another tenant's request meanwhile over its own socket.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent import hand_off
from agent.peer import Peer
from agent.protocol import HelloArgs, HelloResult, encode_frame, read_frame
from agent.server import AgentServer
from tests.agent.conftest import EmulatedHandler

# Far below anything a stalled loop would show (the frame timeout, the held request).
PROMPT_S = 1.0
HELD_S = 30.0


class HoldingHandler(EmulatedHandler):
    """A hello with ``client_name`` "hold" or "hold-unmarked" waits until released;
    "hold" says so first (``hand_off.ahead``), as a handler about to wait must."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()
        self.go = threading.Event()

    def hello(self, peer: Peer, args: HelloArgs) -> HelloResult:
        if args.client_name in ("hold", "hold-unmarked"):
            if args.client_name == "hold":
                hand_off.ahead()
            self.held.set()
            self.go.wait(HELD_S)
        return super().hello(peer, args)


@pytest.fixture
def holding(sock_dir: Path) -> Iterator[tuple[AgentServer, HoldingHandler]]:
    handler = HoldingHandler()
    try:
        with AgentServer(sock_dir / "agent.sock", handler) as server:
            server.start_in_thread()
            yield server, handler
            handler.go.set()
    finally:
        handler.go.set()
        handler.close()


def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HELD_S)
    sock.connect(str(path))
    return sock


def hello(sock: socket.socket, name: str = "other") -> dict[str, Any]:
    sock.sendall(encode_frame({"op": "hello", "args": {"client_name": name}}))
    reply = read_frame(sock, max_frame_bytes=1 << 20)
    assert reply is not None
    return reply


def timed_hello(path: Path) -> float:
    """Seconds a fresh connection's hello takes, connect included."""
    start = time.monotonic()
    with connect(path) as sock:
        assert hello(sock)["ok"] is True
    return time.monotonic() - start


def test_ahead_outside_a_served_request_does_nothing() -> None:
    hand_off.ahead()  # no loop to pass on: returns at once
    calls: list[int] = []
    with hand_off.serving(lambda: calls.append(1)):
        hand_off.ahead()
        hand_off.ahead()  # once per request: the loop has gone on already
    hand_off.ahead()
    assert calls == [1]


@pytest.mark.parametrize("name", ["hold", "hold-unmarked"])
def test_a_waiting_request_leaves_the_others_served(
    holding: tuple[AgentServer, HoldingHandler], name: str
) -> None:
    """Marked, the loop goes on at once; unmarked, the watchdog passes it on."""
    server, handler = holding
    with connect(server.socket_path) as waiting:
        waiting.sendall(encode_frame({"op": "hello", "args": {"client_name": name}}))
        assert handler.held.wait(10)
        took = [timed_hello(server.socket_path) for _ in range(5)]
        assert max(took) < PROMPT_S, took
        handler.go.set()
        reply = read_frame(waiting, max_frame_bytes=1 << 20)
        assert reply is not None and reply["ok"] is True
        # The connection that waited is served by the loop again afterwards.
        assert hello(waiting)["ok"] is True


def test_a_half_sent_frame_leaves_the_others_served(server: AgentServer) -> None:
    with connect(server.socket_path) as slow:
        frame = encode_frame({"op": "hello", "args": {"client_name": "slow"}})
        slow.sendall(frame[:6])  # the header and a byte: the rest is still to come
        time.sleep(0.1)
        took = [timed_hello(server.socket_path) for _ in range(5)]
        assert max(took) < PROMPT_S, took
        slow.sendall(frame[6:])
        reply = read_frame(slow, max_frame_bytes=1 << 20)
        assert reply is not None and reply["ok"] is True


def test_many_waiting_requests_each_finish_and_the_threads_go(
    holding: tuple[AgentServer, HoldingHandler],
) -> None:
    """Eight held requests take eight threads; once answered, only the loop's remain."""
    server, handler = holding
    timed_hello(server.socket_path)  # the loop and its watchdog are running
    at_rest = threading.active_count()
    socks = [connect(server.socket_path) for _ in range(8)]
    try:
        for sock in socks:
            sock.sendall(encode_frame({"op": "hello", "args": {"client_name": "hold"}}))
        deadline = time.monotonic() + 10
        while threading.active_count() < at_rest + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() >= at_rest + 8
        assert timed_hello(server.socket_path) < PROMPT_S
        handler.go.set()
        for sock in socks:
            reply = read_frame(sock, max_frame_bytes=1 << 20)
            assert reply is not None and reply["ok"] is True
        deadline = time.monotonic() + 10
        while threading.active_count() > at_rest and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() == at_rest
        for sock in socks:  # and every one of them is still served
            assert hello(sock)["ok"] is True
    finally:
        for sock in socks:
            sock.close()
