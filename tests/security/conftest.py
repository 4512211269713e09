"""The hostile-tenant suite: a real poold and pool-agent, and local users that attack them.

Every attacker is a forked child that drops to a uid of its own before it touches the
socket, so the agent sees it through SO_PEERCRED exactly as it would see any local user
in the socket's group (dropping uids needs root: the suite skips without it). The
agent runs with small socket limits (:data:`TEST_LIMITS`) so that timeouts and caps
are reached in seconds. Helpers read what the agent holds from /proc: its fds,
threads and memfds, and the host's shared memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from poold.errors import PoolError
from tests.e2e.conftest import NOBODY, Cluster, _start

# Tenant "nobodies" of the e2e cluster allows uid nobody; root is tenant "alpha".
TENANT_UID = NOBODY.pw_uid
# Uids no tenant allows: local users who are merely in the socket's group.
STRANGER_UID = 62001
STRANGER_UIDS = (62001, 62002, 62003, 62004)
SOCKET_GID = NOBODY.pw_gid  # the agent socket's group (--socket-group nogroup)

MAX_CONNECTIONS = 48
MAX_CONNECTIONS_PER_UID = 16
FRAME_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 4.0
REPLY_TIMEOUT_S = 3.0
TEST_LIMITS = {
    "POOL_AGENT_SOCKET_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    "POOL_AGENT_SOCKET_MAX_CONNECTIONS_PER_UID": str(MAX_CONNECTIONS_PER_UID),
    "POOL_AGENT_SOCKET_FRAME_TIMEOUT_S": str(FRAME_TIMEOUT_S),
    "POOL_AGENT_SOCKET_IDLE_TIMEOUT_S": str(IDLE_TIMEOUT_S),
    "POOL_AGENT_SOCKET_REPLY_TIMEOUT_S": str(REPLY_TIMEOUT_S),
}
# What no local user may change in the ledger by talking to the agent's socket.
LEDGER_TABLES = ("tenants", "devices", "device_paths", "leases", "events", "quarantine")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="attackers drop to other uids: root")


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """poold (SQLite) and a pool-agent with a 256 MiB emulated device and small limits."""
    if os.geteuid() != 0:
        pytest.skip("attackers drop to other uids: root")
    for name, value in TEST_LIMITS.items():
        monkeypatch.setenv(name, value)  # the agent child inherits them
    yield from _start(tmp_path, None)


# --- running code as another uid ----------------------------------------------------


class AsUid:
    """``fn`` in a forked child that became ``uid`` (group: the socket's), in the background.

    ``fn`` gets a :class:`Gate`: ``gate.ready(info)`` tells the parent it has done its
    setup (``wait_ready`` returns ``info``), ``gate.wait_go()`` blocks until the parent
    calls :meth:`go`. Its return value (JSON) or PoolError code is :meth:`result`.
    """

    # The parent's ends of every running child's pipes: a later child must not inherit
    # them, or an earlier child's `go` (EOF on its pipe) would never come.
    _parent_ends: ClassVar[set[int]] = set()

    def __init__(self, uid: int, fn: Callable[[Gate], Any], gid: int = SOCKET_GID) -> None:
        out_r, out_w = os.pipe()
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            status = 1
            try:
                for fd in (out_r, go_w, ready_r, *AsUid._parent_ends):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                os.setgroups([gid])
                os.setgid(gid)
                os.setuid(uid)
                try:
                    out: Any = {"ok": fn(Gate(ready_w, go_r))}
                except PoolError as err:
                    out = {"code": err.code, "message": err.message, "detail": err.detail}
                except BaseException:
                    out = {"crash": traceback.format_exc()}
                data = json.dumps(out, default=str).encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(out_w, view) :]
                status = 0
            finally:
                os._exit(status)
        os.close(out_w)
        os.close(go_r)
        os.close(ready_w)
        AsUid._parent_ends.update((out_r, go_w, ready_r))
        self.pid = pid
        self._out = out_r
        self._go = go_w
        self._ready = ready_r
        self._result: Any = None
        self._done = False

    def wait_ready(self, timeout_s: float = 60) -> Any:
        """What the child passed to ``gate.ready``; fails if it ended first."""
        if not select.select([self._ready], [], [], timeout_s)[0]:
            raise AssertionError("the child did not get ready in time")
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(self._ready, 65536)
            if not chunk:
                raise AssertionError(f"the child ended before it was ready: {self.result()}")
            line += chunk
        return json.loads(line)

    def go(self) -> None:
        AsUid._parent_ends.discard(self._go)
        os.close(self._go)
        self._go = -1

    def result(self, timeout_s: float = 120) -> Any:
        if self._done:
            return self._result
        if self._go >= 0:
            self.go()
        deadline = time.monotonic() + timeout_s
        data = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
                raise AssertionError(f"the child (uid) did not finish within {timeout_s} s")
            chunk = os.read(self._out, 1 << 20)
            if not chunk:
                break
            data += chunk
        os.waitpid(self.pid, 0)
        for fd in (self._out, self._ready):
            AsUid._parent_ends.discard(fd)
            os.close(fd)
        self._done = True
        self._result = json.loads(data) if data else {"crash": "no output"}
        assert "crash" not in self._result, self._result["crash"]
        return self._result


class Gate:
    """The child's side of :class:`AsUid`'s two pipes."""

    def __init__(self, ready_w: int, go_r: int) -> None:
        self._ready_w = ready_w
        self._go_r = go_r

    def ready(self, info: Any = None) -> None:
        os.write(self._ready_w, json.dumps(info, default=str).encode() + b"\n")

    def wait_go(self) -> None:
        os.read(self._go_r, 1)  # returns at EOF: the parent closed its end


def as_uid(uid: int, fn: Callable[[], Any], timeout_s: float = 120) -> Any:
    """Run ``fn`` as ``uid`` and return ``{"ok": value}`` or ``{"code": ...}``."""
    return AsUid(uid, lambda gate: fn()).result(timeout_s)


# --- raw socket helpers (for the children) --------------------------------------------


def raw_connect(path: Path, timeout_s: float = 10) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(str(path))
    return sock


def request(op: str, args: dict[str, Any] | None = None) -> bytes:
    body = json.dumps({"op": op, "args": args or {}}).encode()
    return struct.pack(">I", len(body)) + body


def read_reply(sock: socket.socket) -> dict[str, Any] | None:
    """One reply frame, or None at EOF (fds attached are closed)."""
    from agent.protocol import MAX_REPLY_FRAME_BYTES, read_frame

    fds: list[int] = []
    try:
        return read_frame(sock, max_frame_bytes=MAX_REPLY_FRAME_BYTES, fds=fds)
    except ConnectionResetError:
        return None
    finally:
        for fd in fds:
            os.close(fd)


def code(reply: dict[str, Any] | None) -> str | None:
    if reply is None or reply.get("ok") is not False:
        return None
    return str(reply["error"]["code"])


# --- what the agent holds ---------------------------------------------------------------


def _tcp_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/net/{table}") as rows:
            next(rows, None)
            inodes.update(row.split()[9] for row in rows)
    return inodes


def _own_fd(target: str, tcp: set[str]) -> bool:
    """An fd the agent opens on its own, whatever its peers do: its memfds (the warm pool
    refills them), its TCP connections to poold (its HTTP pool keeps as many as grants
    ran at once), its journal (SQLite may reopen it)."""
    return (
        target.startswith("/memfd:poold-")
        or target in tcp
        or os.path.basename(target).startswith("journal.db")
    )


def agent_fds(pid: int) -> int:
    """The agent's open fds that a socket peer could have made it keep (see _own_fd):
    its connections and pipes, and any fd it received and kept (a fuzzer's memfds,
    pipes and /dev/null among them)."""
    tcp = {f"socket:[{inode}]" for inode in _tcp_inodes(pid)}
    count = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            continue
        count += not _own_fd(target, tcp)
    return count


def fd_targets(pid: int) -> list[str]:
    """What each of the agent's fds is (for a failure message)."""
    out = []
    for name in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        with contextlib.suppress(FileNotFoundError):
            out.append(f"{name}={os.readlink(f'/proc/{pid}/fd/{name}')}")
    return out


def agent_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def agent_memfd_bytes(pid: int) -> int:
    """Bytes of the memfds the agent has open now."""
    total = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:"):
                total += os.stat(f"/proc/{pid}/fd/{name}").st_size
        except FileNotFoundError:
            continue
    return total


def shmem_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def settle(pid: int, fds: int, threads: int, timeout_s: float = 15) -> tuple[int, int]:
    """Wait until the agent is back to (at most) ``fds`` fds and ``threads`` threads."""
    deadline = time.monotonic() + timeout_s
    now = (agent_fds(pid), agent_threads(pid))
    while now[0] > fds or now[1] > threads:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
        now = (agent_fds(pid), agent_threads(pid))
    return now


def baseline(cluster: Cluster) -> tuple[int, int]:
    """The idle agent's fds and threads, once the connections of its start are gone."""
    pid = cluster.agent.proc.pid
    time.sleep(0.3)
    return agent_fds(pid), agent_threads(pid)
