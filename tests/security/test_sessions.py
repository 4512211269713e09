"""A tenant session that never reads its socket (issue 13, point 6): its events queue up
to a bound and no further, pushing never waits on it, and neither the agent's
heartbeats nor other tenants' events and replies are held up by it.

The first test floods one session with events in process (AgentServer.push is what the
heartbeat thread calls); the second is the real agent with a hostile local user.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from agent.client import Lease, PoolClient
from agent.protocol import (
    HelloArgs,
    LostEvent,
    RevokeEvent,
    ShrinkEvent,
    encode_request,
    read_frame,
)
from agent.server import DEFAULT_MAX_QUEUED_EVENTS, AgentServer
from tests.agent.conftest import EmulatedHandler
from tests.e2e.conftest import Cluster
from tests.security.conftest import (
    REPLY_TIMEOUT_S,
    TENANT_UID,
    AsUid,
    Gate,
    raw_connect,
    read_reply,
    request,
)

MIB = 1 << 20
SOON = datetime.now(UTC) + timedelta(hours=1)


def wait_for(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return bool(condition())


def unread_session(path: Path) -> socket.socket:
    """A session (hello with events) that will never read again."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(str(path))
    sock.sendall(encode_request("hello", HelloArgs(events=True)))
    reply = read_frame(sock, max_frame_bytes=1 << 20)
    assert reply is not None and reply["ok"] is True
    return sock


def test_an_unread_session_is_bounded_and_holds_up_nobody() -> None:
    handler = EmulatedHandler()
    sock_dir = Path(tempfile.mkdtemp(prefix="poold-sessions-"))  # sun_path is short
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, sock_dir, True)
        cleanup.callback(handler.close)
        flood(sock_dir, handler)


def flood(sock_dir: Path, handler: EmulatedHandler) -> None:
    with AgentServer(sock_dir / "agent.sock", handler) as server:
        server.start_in_thread()
        hostile = unread_session(server.socket_path)
        assert wait_for(lambda: server.sessions() == 1, 5)
        hostile_peer = handler.peers[-1]

        heard: list[datetime] = []
        with PoolClient(server.socket_path, timeout_s=5) as polite:
            lease = polite.lease(MIB, renew=False, on_revoke=lambda _le, at: heard.append(at))
            assert polite.in_session
            assert wait_for(lambda: server.sessions() == 2, 5)
            polite_peer = handler.peers[-1]

            # 20,000 shrink requests for the session that never reads: every push returns
            # at once (the heartbeat thread is never held), the queue stays bounded.
            slowest = 0.0
            for i in range(20_000):
                started = time.monotonic()
                server.push(
                    hostile_peer.connection_id,
                    hostile_peer.pid,
                    ShrinkEvent(lease_id=f"l{i % 4000}", target_bytes=MIB, deadline_at=SOON),
                )
                slowest = max(slowest, time.monotonic() - started)
            assert slowest < 0.05
            assert server.sessions() == 2  # shrinks are dropped for room, never a hang-up

            # Meanwhile the polite tenant's replies and events are prompt.
            started = time.monotonic()
            assert polite.hello().peer_pid == polite_peer.pid
            server.push(
                polite_peer.connection_id,
                polite_peer.pid,
                RevokeEvent(lease_id=lease.lease_id, deadline_at=SOON),
            )
            assert wait_for(lambda: heard == [SOON], 2)
            assert time.monotonic() - started < 2

            # Revokes and losts are never dropped: more of them than the queue holds, and
            # the session that does not read them is hung up on instead.
            for i in range(DEFAULT_MAX_QUEUED_EVENTS + 1):
                server.push(
                    hostile_peer.connection_id,
                    hostile_peer.pid,
                    LostEvent(lease_id=f"gone-{i}", reason="revoked"),
                )
            assert wait_for(lambda: server.sessions() == 1, 5)
            assert polite.in_session and polite.stats().leases_held == 1
            lease.release()
        hostile.close()


# --- the real agent, a hostile local user -----------------------------------------------


def never_reads(path: Path) -> Any:
    """As the hostile uid: a session with a lease, then a flood of requests whose replies
    it never reads, so that its socket is full when its events come."""

    def run(gate: Gate) -> Any:
        sock = raw_connect(path)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request("hello", {"events": True}))
        assert (read_reply(sock) or {}).get("ok") is True
        sock.sendall(request("lease", {"size_bytes": 4 * MIB, "ttl_s": 120, "tenant": "nobodies"}))
        granted = read_reply(sock) or {}
        assert granted.get("ok") is True, granted
        sock.setblocking(False)
        sent = 0
        try:
            while sent < 100_000:
                sock.send(request("list"))
                sent += 1
        except BlockingIOError:
            pass
        gate.ready({"lease_id": granted["result"]["lease_id"], "sent": sent})
        gate.wait_go()
        # Only now: was the connection hung up on (EOF after whatever was buffered)?
        sock.setblocking(True)
        sock.settimeout(10)
        ended = False
        try:
            while sock.recv(1 << 16):
                pass
            ended = True
        except (ConnectionResetError, TimeoutError):
            ended = True
        return {"ended": ended}

    return run


def test_a_hostile_session_that_never_reads_holds_up_no_heartbeat_and_no_tenant(
    hostile: Cluster,
) -> None:
    c = hostile
    attacker = AsUid(TENANT_UID, never_reads(c.socket_path))
    info = attacker.wait_ready()
    heard: list[float] = []
    with PoolClient(c.socket_path, timeout_s=10) as polite:
        lease: Lease = polite.lease(
            4 * MIB, ttl_s=120, renew=False, on_revoke=lambda *_: heard.append(time.monotonic())
        )
        before = next(h for h in c.admin.list_hosts() if h.name == "e2e-host").last_heartbeat_at
        revoked_at = time.monotonic()
        c.admin.revoke(info["lease_id"], reason="hostile", deadline_s=3)
        c.admin.revoke(lease.lease_id, reason="drain", deadline_s=30)
        # The polite tenant hears at once, though the hostile session's socket is full.
        assert wait_for(lambda: bool(heard), 3), "the polite tenant never heard its revoke"
        assert heard[0] - revoked_at < 2
        time.sleep(1)
        after = next(h for h in c.admin.list_hosts() if h.name == "e2e-host").last_heartbeat_at
        assert before is not None and after is not None and after > before
        # The hostile lease is torn down at its deadline all the same.
        assert c.wait_state(info["lease_id"], "reclaimed", timeout_s=10) != "revoking"
        lease.release()
    # The agent gave up on the hostile connection (its replies and events unread).
    time.sleep(REPLY_TIMEOUT_S)
    assert attacker.result()["ok"]["ended"] is True
    assert c.agent.alive(), c.agent.log_tail()
