"""Memory follows the pages: a memfd lease's bytes stay counted while any process maps or
holds the memfd (issue 13, points 1 and 2), against a real poold and pool-agent.

The attackers are forked children that drop to uids of their own (root needed): a
tenant of "nobodies" (quota 64 MiB) and, for the fd-passing attack, a helper of a uid no
tenant allows. Each child takes commands on a pipe and answers one JSON line per step.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import pytest

from agent.client import PoolClient
from poold.errors import PoolError
from tests.e2e.conftest import NOBODY, Cluster, _start

QUOTA = 64 << 20  # tenant "nobodies" of the e2e cluster
HELPER_UID = 62011  # a local user no tenant allows

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attackers drop to other uids: root")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """poold (SQLite) and one agent with a 256 MiB emulated device (tests/e2e)."""
    yield from _start(tmp_path, None)


Step = Callable[[TextIO, Callable[[dict[str, Any]], None]], None]


class Child:
    """A forked process that became ``uid``, runs ``body(commands, say)``, then exits."""

    def __init__(self, uid: int, gid: int, body: Step, keep_fds: tuple[int, ...] = ()) -> None:
        cmd_r, self._cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                os.close(self._cmd_w)
                os.close(out_r)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                with os.fdopen(cmd_r) as commands, os.fdopen(out_w, "w") as out:

                    def say(msg: dict[str, Any]) -> None:
                        out.write(json.dumps(msg, default=str) + "\n")
                        out.flush()

                    try:
                        body(commands, say)
                    except BaseException:
                        say({"error": traceback.format_exc()})
                        code = 1
            finally:
                os._exit(code)
        os.close(cmd_r)
        os.close(out_w)
        for fd in keep_fds:
            os.close(fd)  # the child has its copy
        self._out = os.fdopen(out_r)

    def read(self, timeout_s: float = 30) -> dict[str, Any]:
        import select

        ready, _, _ = select.select([self._out], [], [], timeout_s)
        assert ready, "the child said nothing"
        line = self._out.readline()
        assert line, "the child exited"
        msg: dict[str, Any] = json.loads(line)
        assert "error" not in msg, msg["error"]
        return msg

    def tell(self, command: str) -> None:
        os.write(self._cmd_w, command.encode() + b"\n")

    def wait(self, timeout_s: float = 10) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._close()
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        raise AssertionError(f"child {self.pid} did not exit")

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self._close()

    def _close(self) -> None:
        for close in (self._out.close, lambda: os.close(self._cmd_w)):
            with contextlib.suppress(OSError):
                close()


def leased_bytes(c: Cluster) -> int:
    return int(c.admin.status().leased_bytes)


def event_kinds(c: Cluster, lease_id: str) -> list[str]:
    return [r[3] for r in c.ledger_rows("events")["events"] if r[4] == lease_id]


def poolctl(c: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=c.poolctl_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- (a) N times the quota: release, keep the mapping, lease again -------------------------


def test_released_lease_still_mapped_counts_until_unmapped(cluster: Cluster) -> None:
    sock = str(cluster.socket_path)

    def tenant(commands: TextIO, say: Callable[[dict[str, Any]], None]) -> None:
        with PoolClient(sock) as client:
            first = client.lease(QUOTA, ttl_s=60, renew=False)
            kept = first.mmap()  # mmap keeps its own dup of the fd, and the pages
            kept[:6] = b"stolen"
            first.release()  # the client's fd goes; the mapping stays
            say({"first": first.lease_id, "pid": os.getpid()})
            try:
                client.lease(2 << 20, ttl_s=60, renew=False)
                say({"second": "granted"})
            except PoolError as err:
                say({"code": err.code, "message": err.message})
            commands.readline()  # "unmap"
            assert kept[:6] == b"stolen"  # the memory was never taken away
            kept.close()
            say({"unmapped": True})
            commands.readline()  # "again"
            deadline = time.monotonic() + 15
            while True:
                try:
                    again = client.lease(QUOTA, ttl_s=60, renew=False)
                    break
                except PoolError as err:
                    if err.code != "quota_exceeded" or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            say({"again": again.lease_id})
            again.release()

    child = Child(NOBODY.pw_uid, NOBODY.pw_gid, tenant)
    try:
        got = child.read()
        first = got["first"]
        refused = child.read()
        # The quota is spent on memory the tenant still maps: refused, naming that lease.
        assert refused.get("code") == "quota_exceeded", refused
        assert first in refused["message"] and "released_mapped" in refused["message"]
        assert cluster.admin.show_lease(first).state == "released_mapped"
        assert leased_bytes(cluster) == QUOTA  # the device shows its bytes taken
        # (c) poolctl shows it: the state column, and the audit's leaked mapping with the pid.
        listed = poolctl(cluster, "leases", "list", "--state", "released_mapped")
        assert listed.returncode == 0, listed.stderr
        assert first[:8] in listed.stdout and "released_mapped" in listed.stdout
        audit = poolctl(cluster, "audit", "--json")
        assert audit.returncode != 0, audit.stdout  # something needs looking at
        report = json.loads(audit.stdout)
        leaks = [x for x in report["agents"]["leaked"] if x["lease_id"] == first]
        assert [x["kind"] for x in leaks] == ["leaked_mapping"], report["agents"]
        assert str(got["pid"]) in leaks[0]["message"] and "for " in leaks[0]["message"]
        assert any(x["lease_id"] == first for x in report["pending"])
        # The tenant unmaps: within a few seconds the lease is released, the quota free.
        child.tell("unmap")
        assert child.read() == {"unmapped": True}
        started = time.monotonic()
        assert cluster.wait_state(first, "released", 10) == "released"
        assert time.monotonic() - started < 5
        assert event_kinds(cluster, first)[-2:] == ["lease.release_mapped", "lease.unmapped"]
        child.tell("again")
        assert "again" in child.read()
        assert child.wait() == 0
    finally:
        child.kill()


def test_a_normal_release_is_released_at_once(cluster: Cluster) -> None:
    """The honest path is unchanged: the client closes its fd first, nothing maps it."""
    with PoolClient(cluster.socket_path) as client:
        lease = client.lease(8 << 20, ttl_s=60, renew=False)
        with lease.mmap() as mm:
            mm[:2] = b"ok"
        lease.release()
    # The release rides the outbox (milliseconds behind), straight to released.
    assert cluster.wait_state(lease.lease_id, "released", 2) == "released"
    assert "lease.release_mapped" not in event_kinds(cluster, lease.lease_id)


# --- (b) the fd passed to another process, the tenant gone --------------------------------


def test_memfd_passed_to_another_process_is_never_freed_under_it(cluster: Cluster) -> None:
    sock = str(cluster.socket_path)
    tenant_end, helper_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def helper(commands: TextIO, say: Callable[[dict[str, Any]], None]) -> None:
        tenant_end.close()
        _msg, fds, _flags, _addr = socket.recv_fds(helper_end, 64, 1)
        (fd,) = fds
        mapping = mmap.mmap(fd, QUOTA)
        os.close(fd)  # the mapping alone keeps the pages
        say({"read": mapping[:6].decode(), "pid": os.getpid()})
        commands.readline()  # "write"
        mapping[:6] = b"helper"
        say({"wrote": True})
        commands.readline()  # "exit"

    def attacker(commands: TextIO, say: Callable[[dict[str, Any]], None]) -> None:
        helper_end.close()
        client = PoolClient(sock)
        lease = client.lease(QUOTA, ttl_s=60, renew=False)
        with lease.mmap() as mm:
            mm[:6] = b"secret"
        socket.send_fds(tenant_end, [b"x"], [lease.fd])
        say({"lease": lease.lease_id})
        os._exit(0)  # gone, without a release: the holder is dead

    helper_child = Child(HELPER_UID, HELPER_UID, helper)
    tenant_child = Child(NOBODY.pw_uid, NOBODY.pw_gid, attacker)
    tenant_end.close()
    helper_end.close()
    try:
        lease_id = tenant_child.read()["lease"]
        assert tenant_child.wait() == 0
        seen = helper_child.read()
        assert seen["read"] == "secret"
        # The holder is dead; the orphan grace (1 s) and the reaper (0.2 s) pass several
        # times over: the bytes are never freed while the helper maps them.
        states: set[str] = set()
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            states.add(cluster.admin.show_lease(lease_id).state)
            assert leased_bytes(cluster) == QUOTA, states
            time.sleep(0.1)
        assert states <= {"active", "orphaned", "revoked_mapped"}, states
        assert cluster.admin.show_lease(lease_id).state == "revoked_mapped"
        assert "lease.reclaim" not in event_kinds(cluster, lease_id)
        helper_child.tell("write")
        assert helper_child.read() == {"wrote": True}  # it still has the memory
        audit = poolctl(cluster, "audit", "--json")
        leaks = json.loads(audit.stdout)["agents"]["leaked"]
        assert any(x["lease_id"] == lease_id and str(seen["pid"]) in x["message"] for x in leaks), (
            leaks
        )
        # The helper exits: the pages are gone, and so is the lease.
        helper_child.tell("exit")
        assert helper_child.wait() == 0
        assert cluster.wait_state(lease_id, "reclaimed", 10) == "reclaimed"
        assert leased_bytes(cluster) == 0
        assert event_kinds(cluster, lease_id)[-2:] == ["lease.reclaim_mapped", "lease.unmapped"]
    finally:
        tenant_child.kill()
        helper_child.kill()


# --- (d) the kernel's answer (agent/release_check.py) holds against every way of holding ---


def test_a_read_only_reopen_through_proc_is_still_caught(cluster: Cluster) -> None:
    """The tenant reopens its memfd read-only through /proc/<pid>/fd, then releases: the
    release must not be answered "free" by the kernel's lease check (the read-only file
    is counted), and the bytes stay counted until it is closed."""
    sock = str(cluster.socket_path)

    def tenant(commands: TextIO, say: Callable[[dict[str, Any]], None]) -> None:
        with PoolClient(sock) as client:
            lease = client.lease(8 << 20, ttl_s=60, renew=False)
            kept = os.open(f"/proc/{os.getpid()}/fd/{lease.fd}", os.O_RDONLY)
            lease.release()
            say({"lease": lease.lease_id})
            commands.readline()  # "close"
            os.close(kept)
            say({"closed": True})
            commands.readline()

    child = Child(NOBODY.pw_uid, NOBODY.pw_gid, tenant)
    try:
        lease_id = child.read()["lease"]
        assert cluster.wait_state(lease_id, "released_mapped", 5) == "released_mapped"
        assert leased_bytes(cluster) == 8 << 20
        child.tell("close")
        assert child.read() == {"closed": True}
        assert cluster.wait_state(lease_id, "released", 10) == "released"
        assert leased_bytes(cluster) == 0
    finally:
        child.kill()


def test_an_o_path_kept_past_the_release_holds_nothing(cluster: Cluster) -> None:
    """O_PATH files are not counted by the kernel's check: the release is free at once,
    and the holder is left an inode with no pages that it cannot open again."""
    sock = str(cluster.socket_path)

    def tenant(commands: TextIO, say: Callable[[dict[str, Any]], None]) -> None:
        with PoolClient(sock) as client:
            lease = client.lease(8 << 20, ttl_s=60, renew=False)
            with lease.mmap() as mm:
                mm[:] = b"x" * (8 << 20)
            kept = os.open(f"/proc/self/fd/{lease.fd}", os.O_PATH)
            lease.release()
            say({"lease": lease.lease_id})
            while commands.readline().strip() == "reopen":
                try:
                    os.close(os.open(f"/proc/self/fd/{kept}", os.O_RDWR))
                    reopened = True
                except PermissionError:
                    reopened = False
                say({"reopened": reopened, "blocks": os.fstat(kept).st_blocks})

    child = Child(NOBODY.pw_uid, NOBODY.pw_gid, tenant)
    try:
        lease_id = child.read()["lease"]
        assert cluster.wait_state(lease_id, "released", 5) == "released"
        deadline = time.monotonic() + 5
        while True:  # the pages go off the reply path, within milliseconds
            child.tell("reopen")
            said = child.read()
            if said["blocks"] == 0 or time.monotonic() > deadline:
                break
        assert said == {"reopened": False, "blocks": 0}
        child.tell("exit")
        assert child.wait() == 0
    finally:
        child.kill()
