"""What a handler leaves until after its reply: run by the serving thread once the reply
has left, never before it, and never lost when a piece of it fails."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent import after_reply
from agent.peer import Peer
from agent.protocol import StatsArgs, StatsResult
from agent.server import AgentServer
from tests.agent.conftest import EmulatedHandler
from tests.agent.test_server import call, connect


def test_outside_a_request_nothing_is_taken() -> None:
    ran: list[int] = []
    assert after_reply.defer(lambda: ran.append(1)) is False
    assert ran == []


def test_deferred_work_runs_when_the_request_ends_in_order_past_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("deferred bug")

    with after_reply.serving():
        assert after_reply.defer(lambda: ran.append(1)) is True
        assert after_reply.defer(boom) is True
        assert after_reply.defer(lambda: ran.append(3)) is True
        assert ran == []
    assert ran == [1, 3]
    assert "deferred bug" in caplog.text
    assert after_reply.defer(lambda: ran.append(4)) is False  # the request is over


def test_deferred_work_runs_after_the_reply_left_on_the_serving_thread(
    sock_dir: Path,
) -> None:
    replied = threading.Event()
    seen: dict[str, object] = {}

    class Deferring(EmulatedHandler):
        def stats(self, peer: Peer, args: StatsArgs) -> StatsResult:
            serving = threading.get_ident()

            def later() -> None:
                # The client has the reply before this runs.
                seen["after_reply"] = replied.wait(10)
                seen["same_thread"] = threading.get_ident() == serving

            assert after_reply.defer(later)
            return super().stats(peer, args)

    handler = Deferring()
    try:
        with AgentServer(sock_dir / "agent.sock", handler) as server:
            server.start_in_thread()
            with connect(server.socket_path) as sock:
                assert call(sock, "stats")["ok"] is True
                replied.set()
                assert call(sock, "hello")["ok"] is True  # served once the work is done
        assert seen == {"after_reply": True, "same_thread": True}
    finally:
        handler.close()
