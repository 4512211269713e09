"""How to run poold and an agent as real child processes: the demo, tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A child process with its output in a log file, stopped with SIGTERM then SIGKILL."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def start_poold(
    state_dir: Path,
    port: int,
    *,
    database_url: str | None = None,
    timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> Child:
    argv = [
        sys.executable,
        "-m",
        "poold",
        "serve",
        "--state-dir",
        str(state_dir),
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    if database_url:
        argv += ["--database-url", database_url]
    argv += extra or []
    child = Child("poold", argv, state_dir.parent / f"poold-{port}.log", env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"poold exited at start:\n{child.log_tail()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                return child
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    child.kill()
    raise RuntimeError(f"poold did not answer within {timeout_s}s:\n{child.log_tail()}")


def start_agent(
    work_dir: Path,
    *,
    host: str,
    poold_url: str | list[str],
    credential_file: Path,
    socket_path: Path,
    emulated_capacity_bytes: int | None = None,
    heartbeat_interval_s: float = 1.0,
    extra: list[str] | None = None,
    timeout_s: float = 30.0,
) -> Child:
    argv = [
        sys.executable,
        "-m",
        "agent",
        "serve",
        "--host",
        host,
        # Several poold processes (one ledger): the agent fails over between them in order.
        *(
            arg
            for url in ([poold_url] if isinstance(poold_url, str) else poold_url)
            for arg in ("--poold-url", url)
        ),
        "--credential-file",
        str(credential_file),
        "--socket",
        str(socket_path),
        "--state-dir",
        str(work_dir / f"agent-{host}"),
        "--heartbeat-interval",
        str(heartbeat_interval_s),
        "--log-level",
        "warning",
    ]
    if emulated_capacity_bytes is not None:
        argv += ["--emulated", "--emulated-capacity", str(emulated_capacity_bytes)]
    argv += extra or []
    child = Child("pool-agent", argv, work_dir / f"agent-{host}.log")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"pool-agent exited at start:\n{child.log_tail()}")
        if socket_path.exists() and _accepts(socket_path):
            return child
        time.sleep(0.02)
    child.kill()
    raise RuntimeError(f"pool-agent socket did not appear:\n{child.log_tail()}")


def _accepts(path: Path) -> bool:
    """True when an agent listens there (a stale socket file from a crash refuses)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def admin_client(state_dir: Path, port: int) -> PooldClient:
    token = (state_dir / "admin.token").read_text().strip()
    return PooldClient(f"http://127.0.0.1:{port}", token)


@contextlib.contextmanager
def local_pool(
    *,
    host: str = "bench",
    tenant_quota_bytes: int = 1 << 34,
    tenant_quota_leases: int = 10_000,
    emulated_capacity_bytes: int = 1 << 32,
    heartbeat_interval_s: float = 5.0,
) -> Iterator[tuple[PooldClient, Path]]:
    """poold + one agent as real processes in a temp dir, a host and a tenant for this uid.

    Yields (admin client, agent socket path); stops both on exit. The benchmarks
    run against this, so they measure the real separate-process path.
    """
    work = Path(tempfile.mkdtemp(prefix="poold-bench-"))
    port = free_port()
    state = work / "poold"
    children = [start_poold(state, port)]
    try:
        admin = admin_client(state, port)
        cred = work / "cred"
        cred.write_text(admin.add_host(host).credential)
        admin.create_tenant(
            TenantSpec(
                name=host,
                quota_bytes=tenant_quota_bytes,
                quota_leases=tenant_quota_leases,
                allowed_uids=[os.getuid()],
            )
        )
        sock = work / "agent.sock"
        children.append(
            start_agent(
                work,
                host=host,
                poold_url=admin.base_url,
                credential_file=cred,
                socket_path=sock,
                emulated_capacity_bytes=emulated_capacity_bytes,
                heartbeat_interval_s=heartbeat_interval_s,
            )
        )
        with admin:
            yield admin, sock
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(work, ignore_errors=True)
