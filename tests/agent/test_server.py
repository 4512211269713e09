"""agent.server over real Unix sockets: identity, permissions, errors, fd passing, lifecycle.

:class:`EmulatedHandler` is the test double for the agent's poold link: it grants leases
straight from the emulated backend (the lead's service tests the real link end to end).
test_client.py reuses it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.peer import Peer
from agent.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    HelloArgs,
    HelloResult,
    LeaseResult,
    ReportResult,
    StatsArgs,
    StatsResult,
    encode_frame,
    read_frame,
)
from agent.server import AgentServer, SocketLimits
from tests.agent.conftest import NOBODY, EmulatedHandler


@contextlib.contextmanager
def connect(path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(str(path))
        yield sock
    finally:
        sock.close()


def call(sock: socket.socket, op: str, args: Any = None, fds: list[int] | None = None) -> Any:
    sock.sendall(encode_frame({"op": op, "args": args or {}}))
    return read_frame(sock, max_frame_bytes=1 << 24, fds=fds)


def error_code(reply: dict[str, Any]) -> str:
    assert reply["ok"] is False, reply
    code: str = reply["error"]["code"]
    return code


# --- identity and permissions -------------------------------------------------


def test_hello_reports_the_kernel_identity_of_the_peer(server: AgentServer) -> None:
    with connect(server.socket_path) as sock:
        reply = call(sock, "hello", {"client_name": "pytest"})
    assert reply["ok"] is True
    result = HelloResult.model_validate(reply["result"])
    assert (result.peer_uid, result.peer_gid, result.peer_pid) == (
        os.getuid(),
        os.getgid(),
        os.getpid(),
    )
    assert result.protocol_version == PROTOCOL_VERSION


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to nobody needs root")
def test_identity_comes_from_so_peercred_not_from_the_request(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    sock_dir.chmod(0o711)  # nobody must reach the socket; its own mode decides the rest
    with AgentServer(sock_dir / "agent.sock", handler, group=NOBODY) as server:
        server.start_in_thread()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            status = 1
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                with connect(server.socket_path) as sock:
                    claimed = call(sock, "hello", {"uid": 0, "client_name": "root"})
                    honest = call(sock, "hello", {"client_name": "root"})
                os.write(write_end, json.dumps([claimed, honest]).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            output = pipe.read()
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    claimed, honest = json.loads(output)
    assert error_code(claimed) == "bad_request"  # a claimed uid is not even expressible
    assert honest["result"]["peer_uid"] == NOBODY
    assert honest["result"]["peer_gid"] == NOBODY
    assert honest["result"]["peer_pid"] == pid
    assert [peer.uid for peer in handler.peers] == [NOBODY]


def test_socket_mode_is_set_on_purpose_whatever_the_umask(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    old_umask = os.umask(0o000)
    try:
        with AgentServer(sock_dir / "agent.sock", handler, group=os.getgid()) as server:
            st = os.stat(server.socket_path)
    finally:
        os.umask(old_umask)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getgid()


def test_socket_parent_directory_is_created_traversable(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    with AgentServer(sock_dir / "run" / "agent.sock", handler, mode=0o600) as server:
        assert stat.S_IMODE(os.stat(server.socket_path.parent).st_mode) == 0o755
        assert stat.S_IMODE(os.stat(server.socket_path).st_mode) == 0o600


def test_socket_file_is_removed_at_shutdown(sock_dir: Path, handler: EmulatedHandler) -> None:
    with AgentServer(sock_dir / "agent.sock", handler) as server:
        assert server.socket_path.exists()
    assert not server.socket_path.exists()


# --- start-up checks -----------------------------------------------------------


def test_handler_missing_an_operation_fails_at_construction(sock_dir: Path) -> None:
    class HalfHandler:
        def hello(self, peer: Peer, args: HelloArgs) -> HelloResult:
            raise NotImplementedError

    with pytest.raises(
        TypeError, match="lease, renew, release, shrink, list, stats, report, disconnected"
    ):
        AgentServer(sock_dir / "agent.sock", HalfHandler())  # type: ignore[arg-type]
    assert not (sock_dir / "agent.sock").exists()


def test_stale_socket_is_replaced(sock_dir: Path, handler: EmulatedHandler) -> None:
    path = sock_dir / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # bound, never listening: what a crashed agent leaves
    with AgentServer(path, handler) as server:
        server.start_in_thread()
        with connect(path) as sock:
            assert call(sock, "hello")["ok"] is True


def test_live_agent_socket_is_not_stolen(server: AgentServer, handler: EmulatedHandler) -> None:
    with pytest.raises(OSError, match="already listening"):
        AgentServer(server.socket_path, handler)
    with connect(server.socket_path) as sock:
        assert call(sock, "hello")["ok"] is True


def test_non_socket_file_is_not_replaced(sock_dir: Path, handler: EmulatedHandler) -> None:
    path = sock_dir / "agent.sock"
    path.write_text("precious")
    with pytest.raises(FileExistsError):
        AgentServer(path, handler)
    assert path.read_text() == "precious"


def test_adopts_an_already_listening_socket(sock_dir: Path, handler: EmulatedHandler) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_dir / "activated.sock"))
    os.chmod(sock_dir / "activated.sock", 0o666)  # noqa: S103  # as a .socket unit's SocketMode
    listener.listen()
    with AgentServer(None, handler, listen_socket=listener) as server:
        server.start_in_thread()
        assert server.socket_path == sock_dir / "activated.sock"
        assert stat.S_IMODE(os.stat(server.socket_path).st_mode) == 0o666
        with connect(server.socket_path) as sock:
            assert call(sock, "hello")["ok"] is True
    assert listener.fileno() == -1  # shutdown closed the adopted socket


# --- bad clients -----------------------------------------------------------------


def test_oversized_frame_is_refused_and_the_connection_closed(server: AgentServer) -> None:
    with connect(server.socket_path) as greedy, connect(server.socket_path) as bystander:
        greedy.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))  # the body never comes
        reply = read_frame(greedy)
        assert reply is not None
        assert error_code(reply) == "frame_too_large"
        assert read_frame(greedy) is None  # hung up without waiting for the body
        assert call(bystander, "hello")["ok"] is True


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b'"string"', b""])
def test_undecodable_frame_gets_bad_request_and_close(server: AgentServer, body: bytes) -> None:
    with connect(server.socket_path) as sock:
        sock.sendall(struct.pack(">I", len(body)) + body)
        reply = read_frame(sock)
        assert reply is not None
        assert error_code(reply) == "bad_request"
        assert read_frame(sock) is None
    with connect(server.socket_path) as sock:
        assert call(sock, "hello")["ok"] is True


@pytest.mark.parametrize(
    ("request_body", "code"),
    [
        ({"op": "format_disk", "args": {}}, "bad_request"),
        ({"op": 7, "args": {}}, "bad_request"),
        ({"args": {}}, "bad_request"),
        ({"op": "hello", "args": [1]}, "bad_request"),
        ({"op": "hello", "args": {}, "uid": 0}, "bad_request"),
        ({"op": "lease", "args": {}}, "invalid_size"),
        ({"op": "lease", "args": {"size_bytes": 0}}, "invalid_size"),
        ({"op": "lease", "args": {"size_bytes": -4096}}, "invalid_size"),
        ({"op": "lease", "args": {"size_bytes": 1 << 60}}, "invalid_size"),
        ({"op": "lease", "args": {"size_bytes": "lots"}}, "invalid_size"),
        ({"op": "lease", "args": {"size_bytes": 4096, "ttl_s": 0}}, "bad_request"),
        ({"op": "lease", "args": {"size_bytes": 4096, "tenant": "../etc"}}, "bad_request"),
        ({"op": "lease", "args": {"size_bytes": 4096, "holder_uid": 0}}, "bad_request"),
        ({"op": "renew", "args": {"lease_id": ""}}, "bad_request"),
        ({"op": "renew", "args": {"lease_id": "lease-404"}}, "unknown_lease"),
        (
            {
                "op": "report",
                "args": {
                    "lease_id": "x",
                    "used_bytes": 1,
                    "exclusive_bytes": 2,
                    "replica_bytes": 0,
                },
            },
            "bad_request",
        ),
    ],
)
def test_invalid_requests_get_a_code_and_the_connection_stays_up(
    server: AgentServer, request_body: dict[str, Any], code: str
) -> None:
    with connect(server.socket_path) as sock:
        sock.sendall(encode_frame(request_body))
        reply = read_frame(sock)
        assert reply is not None
        assert error_code(reply) == code
        assert reply["error"]["message"]
        assert call(sock, "hello")["ok"] is True


def test_a_tenant_looping_on_a_refusal_is_one_log_line(
    server: AgentServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Every refusal reaches the tenant in its reply; the agent's log gets the first of
    a uid and code, not one line per request (the rest are summarised a minute later)."""
    with caplog.at_level("INFO", logger="agent.server"), connect(server.socket_path) as sock:
        for _ in range(200):
            reply = call(sock, "lease", {"size_bytes": 0})
            assert error_code(reply) == "invalid_size"
        assert error_code(call(sock, "renew", {"lease_id": "nope"})) == "unknown_lease"
        for n in range(50):  # names it makes up are one key, not one line each
            assert error_code(call(sock, f"op-{n}")) == "bad_request"
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused:")]
    assert len(refused) == 3, refused
    assert refused[0].startswith(f"refused: invalid_size (uid {os.getuid()}, lease): ")
    assert refused[1].startswith(f"refused: unknown_lease (uid {os.getuid()}, renew): ")
    assert refused[2].startswith(f"refused: bad_request (uid {os.getuid()}, ?): ")


def test_handler_bug_is_internal_and_the_connection_survives(
    server: AgentServer, caplog: pytest.LogCaptureFixture
) -> None:
    with connect(server.socket_path) as sock:
        reply = call(sock, "lease", {"size_bytes": 4096, "labels": {"boom": "1"}})
        assert error_code(reply) == "internal"
        assert "handler bug" not in reply["error"]["message"]  # details go to the log only
        assert call(sock, "hello")["ok"] is True
    assert "handler bug" in caplog.text


def test_handler_returning_the_wrong_model_is_internal(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    class WrongStats(EmulatedHandler):
        def stats(self, peer: Peer, args: StatsArgs) -> StatsResult:
            return ReportResult(accepted=True)  # type: ignore[return-value]

    wrong = WrongStats()
    with AgentServer(sock_dir / "agent.sock", wrong) as server:
        server.start_in_thread()
        with connect(server.socket_path) as sock:
            assert error_code(call(sock, "stats")) == "internal"


def test_fds_sent_by_a_tenant_are_dropped(server: AgentServer) -> None:
    """A tenant cannot make the agent (root) hold fds of its choosing."""
    fds_before = len(os.listdir("/proc/self/fd"))
    read_end, write_end = os.pipe()
    try:
        with connect(server.socket_path) as sock:
            for _ in range(50):
                frame = encode_frame({"op": "hello", "args": {}})
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read_end]))]
                sock.sendmsg([frame], rights)
                assert read_frame(sock) is not None
    finally:
        os.close(read_end)
        os.close(write_end)
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 5


def test_connection_cap_turns_extra_clients_away_politely(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    with AgentServer(sock_dir / "agent.sock", handler, max_connections=1) as server:
        server.start_in_thread()
        with connect(server.socket_path) as first:
            assert call(first, "hello")["ok"] is True
            with connect(server.socket_path) as second:
                reply = read_frame(second)
                assert reply is not None
                assert error_code(reply) == "agent_busy"
                assert read_frame(second) is None
            assert call(first, "hello")["ok"] is True


# --- leases and lifecycle ----------------------------------------------------------


def test_lease_reply_carries_the_handlers_memory(
    server: AgentServer, handler: EmulatedHandler
) -> None:
    fds: list[int] = []
    with connect(server.socket_path) as sock:
        reply = call(sock, "lease", {"size_bytes": 10_000}, fds=fds)
    try:
        assert reply["ok"] is True, reply
        assert len(fds) == 1
        result = LeaseResult.model_validate(reply["result"])
        assert result.length_bytes == 12_288
        _, _, materialised = handler.granted[result.lease_id]
        assert fds[0] != materialised.fd
        assert os.fstat(fds[0]).st_ino == os.fstat(materialised.fd).st_ino
        assert not os.get_inheritable(fds[0])  # received close-on-exec
        os.pwrite(fds[0], b"kv-block", 4096)
        assert os.pread(materialised.fd, 8, 4096) == b"kv-block"
    finally:
        for fd in fds:
            os.close(fd)


def test_disconnect_reaches_the_handler(server: AgentServer, handler: EmulatedHandler) -> None:
    with connect(server.socket_path) as sock:
        assert call(sock, "hello")["ok"] is True
    assert handler.disconnected_event.wait(5)
    (peer,) = handler.disconnects
    assert (peer.uid, peer.pid) == (os.getuid(), os.getpid())
    assert peer.connection_id == handler.peers[0].connection_id


def test_shutdown_closes_open_connections(sock_dir: Path, handler: EmulatedHandler) -> None:
    server = AgentServer(sock_dir / "agent.sock", handler)
    server.start_in_thread()
    with connect(server.socket_path) as sock:
        assert call(sock, "hello")["ok"] is True
        server.shutdown()
        assert read_frame(sock) is None
        assert handler.disconnected_event.wait(5)
        assert server.connection_count == 0
    server.shutdown()  # twice is fine


def test_many_concurrent_clients(server: AgentServer) -> None:
    errors: list[BaseException] = []

    def chatter() -> None:
        try:
            with connect(server.socket_path) as sock:
                for _ in range(20):
                    assert call(sock, "stats")["ok"] is True
        except BaseException as err:  # surfaced below, in the test thread
            errors.append(err)

    threads = [threading.Thread(target=chatter) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_shutdown_from_a_signal_handler_on_the_serving_thread(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    """As pool-agent on SIGTERM: serve_forever on the main thread, shutdown in the handler."""
    server = AgentServer(sock_dir / "agent.sock", handler)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: server.shutdown())
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        server.serve_forever()  # returns once the handler ran
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert not server.socket_path.exists()
    server.shutdown()


def test_connections_their_peers_closed_do_not_count_against_the_cap(
    sock_dir: Path, handler: EmulatedHandler
) -> None:
    """A burst opened and dropped at once is not held against the next connection of its
    uid, however many of its hang-ups the server has yet to read."""
    limits = SocketLimits(max_connections_per_uid=4)
    with AgentServer(sock_dir / "agent.sock", handler, limits=limits) as server:
        server.start_in_thread()
        for _ in range(20):
            burst = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
            for sock in burst:
                with contextlib.suppress(OSError):
                    sock.connect(str(server.socket_path))
            for sock in burst:
                sock.close()
            with connect(server.socket_path) as sock:
                reply = call(sock, "hello", {"client_name": "after the burst"})
            assert reply["ok"] is True, reply
