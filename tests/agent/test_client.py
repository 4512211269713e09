"""agent.client against a real AgentServer: fds, mmap, renewal, release, reconnection."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.client import Lease, PoolClient
from agent.paths import SOCKET_ENV, SYSTEM_SOCKET_PATH, client_socket_path, default_socket_path
from agent.peer import Peer
from agent.protocol import (
    Event,
    HelloArgs,
    HelloResult,
    LostEvent,
    RevokeEvent,
    ShrinkEvent,
    encode_error,
    read_frame,
)
from agent.server import AgentServer
from poold.errors import (
    AgentBusy,
    AgentUnreachable,
    BadRequest,
    InvalidSize,
    LeaseNotActive,
    NoCapacity,
    UnknownLease,
)
from tests.agent.conftest import EmulatedHandler

MIB = 1 << 20


@pytest.fixture
def client(server: AgentServer) -> Iterator[PoolClient]:
    with PoolClient(server.socket_path, timeout_s=10) as client:
        yield client


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


# --- memory ---------------------------------------------------------------------


def test_lease_maps_writes_and_reads_back(client: PoolClient) -> None:
    with client.lease(3 * MIB, tenant="llm-a", labels={"model": "llama-70b"}) as lease:
        assert lease.size_bytes == 3 * MIB
        assert lease.length_bytes >= lease.size_bytes
        assert (lease.backend, lease.media, lease.epoch) == ("emulated", "emulated", 1)
        assert lease.page_size_bytes == 4096
        with lease.mmap() as view:
            view[:5] = b"hello"
            view[-5:] = b"world"
        with lease.mmap() as again:
            assert again[:5] == b"hello"
            assert again[-5:] == b"world"


def test_fresh_lease_reads_zeros(client: PoolClient) -> None:
    with client.lease(MIB) as dirty, dirty.mmap() as view:
        view[:] = b"\xab" * MIB
    with client.lease(MIB) as fresh, fresh.mmap() as view:
        assert view[:] == bytes(MIB)


def test_received_fd_is_sealed_and_close_on_exec(client: PoolClient) -> None:
    with client.lease(MIB) as lease:
        assert not os.get_inheritable(lease.fd)
        for length in (2 * MIB, MIB // 2):
            with pytest.raises(PermissionError) as caught:
                os.ftruncate(lease.fd, length)
            assert caught.value.errno == errno.EPERM


# --- release -----------------------------------------------------------------------


def test_context_manager_releases(client: PoolClient, handler: EmulatedHandler) -> None:
    with client.lease(MIB) as lease:
        assert handler.states[lease.lease_id] == "active"
    assert handler.states[lease.lease_id] == "released"
    assert lease.released
    with pytest.raises(LeaseNotActive):
        _ = lease.fd
    assert client.leases == []


def test_release_is_idempotent(client: PoolClient, handler: EmulatedHandler) -> None:
    lease = client.lease(MIB)
    lease.release()
    lease.release()
    assert handler.releases[lease.lease_id] == 1


def test_release_of_a_lease_already_over_is_quiet(
    client: PoolClient, handler: EmulatedHandler
) -> None:
    lease = client.lease(MIB, renew=False)
    handler.expire(lease.lease_id)
    lease.release()  # lease_not_active from the agent: nothing left to give back
    assert lease.released


def test_exception_in_block_still_releases(client: PoolClient, handler: EmulatedHandler) -> None:
    with pytest.raises(KeyError), client.lease(MIB) as lease:
        raise KeyError("engine crashed")
    assert handler.states[lease.lease_id] == "released"


def test_close_releases_every_lease(server: AgentServer, handler: EmulatedHandler) -> None:
    client = PoolClient(server.socket_path)
    leases = [client.lease(MIB) for _ in range(3)]
    client.close()
    client.close()
    assert all(handler.states[lease.lease_id] == "released" for lease in leases)
    assert all(lease.released for lease in leases)
    with pytest.raises(AgentUnreachable, match="closed"):
        client.stats()


# --- renewal -----------------------------------------------------------------------


def test_background_renewal(client: PoolClient, handler: EmulatedHandler) -> None:
    with client.lease(MIB, ttl_s=1) as lease:
        first_expiry = lease.expires_at
        assert wait_for(lambda: handler.renewals.get(lease.lease_id, 0) >= 2, timeout_s=3)
        assert lease.expires_at > first_expiry
    count = handler.renewals[lease.lease_id]
    time.sleep(0.5)
    assert handler.renewals[lease.lease_id] == count  # released: renewing stopped


def test_renew_false_leaves_renewal_to_the_caller(
    client: PoolClient, handler: EmulatedHandler
) -> None:
    with client.lease(MIB, ttl_s=1, renew=False) as lease:
        time.sleep(0.5)
        assert lease.lease_id not in handler.renewals
        lease.renew(ttl_s=5)
        assert (handler.renewals[lease.lease_id], lease.ttl_s) == (1, 5)


def test_lease_lost_when_the_agent_says_it_is_over(
    client: PoolClient, handler: EmulatedHandler
) -> None:
    lost: list[Lease] = []
    with client.lease(MIB, ttl_s=1, on_lost=lost.append) as lease:
        handler.expire(lease.lease_id)
        assert wait_for(lambda: lease.lost)
        assert lost == [lease]
        time.sleep(0.5)
        assert lease.lease_id not in handler.renewals  # no more attempts once lost


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("size_bytes", [0, -1, 1 << 60])
def test_invalid_size_is_refused_before_sending(client: PoolClient, size_bytes: int) -> None:
    with pytest.raises(InvalidSize) as caught:
        client.lease(size_bytes)
    assert caught.value.code == "invalid_size"


def test_agent_errors_arrive_with_their_code(client: PoolClient) -> None:
    with pytest.raises(UnknownLease) as caught:
        client.renew("lease-404")
    assert caught.value.code == "unknown_lease"
    assert client.hello().peer_uid == os.getuid()  # same connection, still fine


def test_no_agent_is_agent_unreachable(sock_dir: Path) -> None:
    with (
        PoolClient(sock_dir / "nobody-home.sock") as client,
        pytest.raises(AgentUnreachable) as caught,
    ):
        client.hello()
    assert caught.value.code == "agent_unreachable"
    assert "nobody-home.sock" in caught.value.message


def test_busy_agent_says_so(sock_dir: Path, handler: EmulatedHandler) -> None:
    with AgentServer(sock_dir / "agent.sock", handler, max_connections=1) as server:
        server.start_in_thread()
        with PoolClient(server.socket_path) as first, PoolClient(server.socket_path) as second:
            first.hello()
            with pytest.raises(AgentBusy):
                second.hello()


def test_reconnects_after_an_agent_restart(sock_dir: Path, handler: EmulatedHandler) -> None:
    path = sock_dir / "agent.sock"
    with AgentServer(path, handler) as server:
        server.start_in_thread()
        client = PoolClient(path)
        assert client.hello().peer_pid == os.getpid()
    try:
        with AgentServer(path, handler) as restarted:
            restarted.start_in_thread()
            assert client.stats().poold_reachable
            with client.lease(MIB) as lease:  # a request that never left may be re-sent
                assert lease.length_bytes == MIB
    finally:
        client.close()


class OneShotAgent:
    """Reads one request per connection, then hangs up without replying."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen()
        self.requests: list[dict[str, object]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                frame = read_frame(conn)
                if frame is not None:
                    self.requests.append(frame)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(5)


@pytest.fixture
def one_shot(sock_dir: Path) -> Iterator[OneShotAgent]:
    agent = OneShotAgent(sock_dir / "flaky.sock")
    yield agent
    agent.close()


def test_lease_is_never_sent_twice(sock_dir: Path, one_shot: OneShotAgent) -> None:
    with PoolClient(sock_dir / "flaky.sock") as client, pytest.raises(AgentUnreachable):
        client.lease(MIB)
    assert [request["op"] for request in one_shot.requests] == ["lease"]


def test_idempotent_requests_retry_once(sock_dir: Path, one_shot: OneShotAgent) -> None:
    with PoolClient(sock_dir / "flaky.sock") as client, pytest.raises(AgentUnreachable):
        client.stats()
    assert [request["op"] for request in one_shot.requests] == ["stats", "stats"]


def test_lease_error_reply_with_a_stray_fd_does_not_leak(sock_dir: Path) -> None:
    """An error reply that (wrongly) carries an fd: the client closes it and raises the error."""
    path = sock_dir / "odd.sock"
    fds_before = len(os.listdir("/proc/self/fd"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()

        def reply_with_fd() -> None:
            conn, _ = listener.accept()
            with conn:
                read_frame(conn)
                stray = os.memfd_create("stray")
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", stray))]
                conn.sendmsg([encode_error(NoCapacity("pool is full"))], rights)
                os.close(stray)
                read_frame(conn)  # until the client hangs up

        thread = threading.Thread(target=reply_with_fd)
        thread.start()
        with PoolClient(path) as client, pytest.raises(NoCapacity):
            client.lease(MIB)
        thread.join(5)
    assert len(os.listdir("/proc/self/fd")) <= fds_before


# --- the rest of the surface ----------------------------------------------------------


def test_list_stats_report(client: PoolClient) -> None:
    with client.lease(MIB) as first, client.lease(2 * MIB) as second:
        listed = {listing.lease_id: listing for listing in client.list()}
        assert set(listed) == {first.lease_id, second.lease_id}
        assert listed[second.lease_id].state == "active"
        assert listed[second.lease_id].length_bytes == 2 * MIB
        stats = client.stats()
        assert (stats.leases_held, stats.bytes_held) == (2, 3 * MIB)
        assert first.report(used_bytes=MIB, exclusive_bytes=MIB // 2, replica_bytes=MIB // 4)
        assert client.leases == [first, second]


def test_one_client_many_threads(client: PoolClient) -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(10):
                with client.lease(64 * 1024) as lease:
                    lease.renew()
                client.stats()
        except BaseException as err:  # surfaced below, in the test thread
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert client.leases == []


def test_default_socket_path_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, sock_dir: Path
) -> None:
    monkeypatch.setenv(SOCKET_ENV, str(sock_dir / "env.sock"))
    with PoolClient() as client:
        assert client.socket_path == sock_dir / "env.sock"


def test_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_socket_path(0) == SYSTEM_SOCKET_PATH == Path("/run/poold/agent.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path(1000) == Path("/run/user/1000/poold/agent.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path(1000) == Path("/tmp/poold-1000/agent.sock")
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    expected = SYSTEM_SOCKET_PATH if SYSTEM_SOCKET_PATH.exists() else default_socket_path()
    assert client_socket_path() == expected


# --- tenant sessions ------------------------------------------------------------------

SOON = datetime.now(UTC) + timedelta(hours=1)


def peer_of(handler: EmulatedHandler, lease: Lease) -> Peer:
    return handler.granted[lease.lease_id][0]


def push(server: AgentServer, handler: EmulatedHandler, lease: Lease, event: Event) -> bool:
    peer = peer_of(handler, lease)
    return server.push(peer.connection_id, peer.pid, event)


def test_a_client_holding_a_lease_is_in_session(
    server: AgentServer, handler: EmulatedHandler
) -> None:
    with PoolClient(server.socket_path, timeout_s=10) as client:
        client.hello()
        assert not client.in_session  # no lease yet: a plain connection
        with client.lease(MIB, renew=False):
            assert client.in_session
            assert wait_for(lambda: server.sessions() == 1)
            assert client.hello().peer_pid == os.getpid()  # replies still come through


def test_pushed_events_fire_each_callback_once(
    server: AgentServer, handler: EmulatedHandler
) -> None:
    heard: list[tuple[str, object]] = []
    with PoolClient(server.socket_path, timeout_s=10) as client:
        lease = client.lease(
            MIB,
            renew=False,
            on_revoke=lambda _le, at: heard.append(("revoke", at)),
            on_shrink=lambda _le, n, at: heard.append(("shrink", n)),
            on_lost=lambda le: heard.append(("lost", le.lost_reason)),
        )
        shrink = ShrinkEvent(
            lease_id=lease.lease_id, target_bytes=4096, replica_bytes=4096, deadline_at=SOON
        )
        assert push(server, handler, lease, shrink)
        assert push(server, handler, lease, shrink)  # the same request: told once
        assert push(server, handler, lease, RevokeEvent(lease_id=lease.lease_id, deadline_at=SOON))
        # An event of a lease this client does not hold is ignored.
        assert push(server, handler, lease, LostEvent(lease_id="other", reason="revoked"))
        assert push(server, handler, lease, LostEvent(lease_id=lease.lease_id, reason="revoked"))
        assert wait_for(lambda: len(heard) == 3)
        time.sleep(0.2)
        assert heard == [("shrink", 4096), ("revoke", SOON), ("lost", "revoked")]
        assert lease.shrink_replica_bytes == 4096
        assert lease.revoke_deadline_at == SOON and lease.lost
        lease._revoked(SOON)  # the renewal path bringing the same news: nothing more
        assert len(heard) == 3


def test_a_slow_callback_does_not_stall_replies(
    server: AgentServer, handler: EmulatedHandler
) -> None:
    release_callback = threading.Event()
    with PoolClient(server.socket_path, timeout_s=10) as client:
        lease = client.lease(MIB, renew=False, on_revoke=lambda *_: release_callback.wait(10))
        push(server, handler, lease, RevokeEvent(lease_id=lease.lease_id, deadline_at=SOON))
        time.sleep(0.1)
        started = time.monotonic()
        for _ in range(20):
            client.stats()
        assert time.monotonic() - started < 2
        release_callback.set()


def test_a_client_without_events_gets_none(server: AgentServer, handler: EmulatedHandler) -> None:
    heard: list[datetime] = []
    with PoolClient(server.socket_path, timeout_s=10, events=False) as client:
        lease = client.lease(MIB, renew=False, on_revoke=lambda _le, at: heard.append(at))
        assert not client.in_session and server.sessions() == 0
        event = RevokeEvent(lease_id=lease.lease_id, deadline_at=SOON)
        assert not push(server, handler, lease, event)
        time.sleep(0.2)
        assert heard == []
        lease.release()


def test_an_agent_without_sessions_is_served_by_renewals(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    """A protocol-1 agent refuses `events` in hello: the client carries on without."""

    class OldAgent(EmulatedHandler):
        def hello(self, peer: Peer, args: HelloArgs) -> HelloResult:
            if args.events:
                raise BadRequest("invalid hello arguments: events: Extra inputs are not permitted")
            return super().hello(peer, args)

    old = OldAgent()
    try:
        with AgentServer(sock_dir / "old.sock", old) as server:
            server.start_in_thread()
            with (
                PoolClient(server.socket_path, timeout_s=10) as client,
                client.lease(MIB, renew=False) as lease,
            ):
                assert not client.in_session and not client.events
                assert lease.renew() > datetime.now(UTC)
    finally:
        old.close()


def test_a_dropped_session_reconnects_and_keeps_what_the_agent_holds(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    path = sock_dir / "agent.sock"
    lost: list[str | None] = []
    server = AgentServer(path, handler)
    server.start_in_thread()
    client = PoolClient(path, timeout_s=5, reconnect_s=5)
    try:
        kept = client.lease(MIB, renew=False, on_lost=lambda le: lost.append(le.lost_reason))
        gone = client.lease(MIB, renew=False, on_lost=lambda le: lost.append(le.lost_reason))
        server.shutdown()
        del handler.granted[gone.lease_id]  # the agent came back without it
        with AgentServer(path, handler) as restarted:
            restarted.start_in_thread()
            assert wait_for(lambda: client.in_session and lost == ["not_held"])
            assert not kept.lost and gone.lost and gone.lost_reason == "not_held"
            assert wait_for(lambda: restarted.sessions() == 1)
            kept.release()
    finally:
        client.close()


def test_by_default_a_lease_is_lost_when_its_ttl_runs_out_not_before(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    # The agent is away (a restart takes seconds; under systemd well under a ttl): a
    # lease stays the tenant's until nobody renewed it for its whole ttl.
    lost: list[tuple[str, float]] = []
    with AgentServer(sock_dir / "agent.sock", handler) as server:
        server.start_in_thread()
        client = PoolClient(server.socket_path, timeout_s=5)
        short = client.lease(
            MIB,
            ttl_s=2,
            renew=False,
            on_lost=lambda le: lost.append((le.lease_id, time.monotonic())),
        )
        long = client.lease(
            MIB,
            ttl_s=60,
            renew=False,
            on_lost=lambda le: lost.append((le.lease_id, time.monotonic())),
        )
        gone_at = time.monotonic()
    try:
        assert wait_for(lambda: bool(lost), timeout_s=6)
        ((lease_id, at),) = lost
        assert lease_id == short.lease_id and short.lost_reason == "connection_lost"
        assert 1.0 < at - gone_at < 3.5  # at its expiry (2 s from its grant), not at once
        time.sleep(0.5)
        assert not long.lost  # its ttl has a minute to go: the agent may still come back
    finally:
        client.close()


def test_no_agent_to_reconnect_to_loses_every_lease(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    lost: list[str | None] = []
    with AgentServer(sock_dir / "agent.sock", handler) as server:
        server.start_in_thread()
        client = PoolClient(server.socket_path, timeout_s=5, reconnect_s=0.5)
        leases = [
            client.lease(MIB, renew=False, on_lost=lambda le: lost.append(le.lost_reason))
            for _ in range(2)
        ]
    try:
        assert wait_for(lambda: len(lost) == 2)
        assert lost == ["connection_lost"] * 2 and all(lease.lost for lease in leases)
    finally:
        client.close()
