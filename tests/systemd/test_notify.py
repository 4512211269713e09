"""Real `poold serve` and `pool-agent serve` tell systemd READY=1, then WATCHDOG=1.

The test is systemd here: it binds the datagram socket named by NOTIFY_SOCKET (a path,
and the abstract namespace with a leading `@`), sets WATCHDOG_USEC small, and reads
what each daemon sends.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from poold import notify, procs

WATCHDOG_USEC = 400_000  # a ping every 0.2 s


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    short = Path(tempfile.mkdtemp(prefix="pn-"))  # AF_UNIX paths are short
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = short / "notify"
    sock.bind(str(path))
    try:
        yield sock, str(path)
    finally:
        sock.close()
        shutil.rmtree(short, ignore_errors=True)


def received(sock: socket.socket, want: list[str], timeout_s: float = 30.0) -> list[str]:
    """Messages read until each of ``want`` was seen in that order (or the time is up)."""
    seen: list[str] = []
    pending = list(want)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(4096).decode()
        except TimeoutError:
            break
        lines = data.split("\n")
        seen.extend(lines)
        if pending[0] in lines:
            pending.pop(0)
    return seen


def notify_env(address: str) -> dict[str, str]:
    return {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": str(WATCHDOG_USEC)}


def test_notify_does_nothing_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert notify.notify(notify.READY) is False
    assert notify.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert notify.watchdog_interval_s() is None  # another process is the one watched
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval_s() == 0.5


def test_notify_reaches_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"poold-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.notify(notify.READY, "STATUS=x") is True
        sock.settimeout(5)
        assert sock.recv(100) == b"READY=1\nSTATUS=x"


def test_poold_serve_says_ready_then_feeds_the_watchdog(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, address = notify_socket
    port = procs.free_port()
    poold = procs.start_poold(tmp_path / "poold", port, env=notify_env(address))
    try:
        seen = received(sock, ["READY=1", "WATCHDOG=1", "WATCHDOG=1"])
        # READY once the HTTP socket answers (start_poold saw /v1/health too).
        assert "READY=1" in seen, seen
        assert seen.count("WATCHDOG=1") >= 2, seen
        assert seen.index("READY=1") < seen.index("WATCHDOG=1")
    finally:
        # uvicorn shuts down, then re-raises SIGTERM on itself: systemd counts that clean.
        assert poold.stop() in (0, -15), poold.log_tail()
    assert "STOPPING=1" in received(sock, ["STOPPING=1"], timeout_s=5)


def test_pool_agent_serve_says_ready_then_feeds_the_watchdog(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, address = notify_socket
    port = procs.free_port()
    state = tmp_path / "poold"
    poold = procs.start_poold(state, port)  # no NOTIFY_SOCKET: only the agent speaks
    run_dir = Path(tempfile.mkdtemp(prefix="pa-"))
    agent: procs.Child | None = None
    try:
        with procs.admin_client(state, port) as admin:
            credential = tmp_path / "credential"
            credential.write_text(admin.add_host("nt-host").credential)
        agent = procs.Child(
            "pool-agent",
            [
                sys.executable,
                "-m",
                "agent",
                "serve",
                "--host",
                "nt-host",
                "--poold-url",
                f"http://127.0.0.1:{port}",
                "--credential-file",
                str(credential),
                "--socket",
                str(run_dir / "agent.sock"),
                "--state-dir",
                str(tmp_path / "agent"),
                "--emulated",
                "--emulated-capacity",
                "64MiB",
                "--log-level",
                "warning",
            ],
            tmp_path / "agent.log",
            env=notify_env(address),
        )
        seen = received(sock, ["READY=1", "WATCHDOG=1", "WATCHDOG=1"])
        assert "READY=1" in seen, (seen, agent.log_tail())
        assert seen.count("WATCHDOG=1") >= 2, (seen, agent.log_tail())
        assert seen.index("READY=1") < seen.index("WATCHDOG=1")
        assert (run_dir / "agent.sock").exists()  # READY came with the socket up
    finally:
        if agent is not None:
            assert agent.stop() == 0, agent.log_tail()
        poold.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
