"""poolrun gives a program a lease as a path: real poold, agent, poolrun and CMD processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent import poolrun
from tests.e2e.conftest import Cluster

MIB = 1 << 20


def poolrun_argv(cluster: Cluster, *args: str) -> list[str]:
    return [sys.executable, "-m", "agent.poolrun", "--socket", str(cluster.socket_path), *args]


def cmd(script: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(script)]


def wait_line(proc: subprocess.Popen[str], timeout_s: float = 30) -> str:
    """The next line CMD prints (through poolrun's inherited stdout)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    line = proc.stdout.readline()
    assert time.monotonic() < deadline and line, "CMD printed nothing"
    return line.strip()


MAPS_THE_PATH = """
    import mmap, os, sys
    env = os.environ
    length = int(env["POOLD_LEASE_BYTES"])
    with open(env["POOLD_LEASE_PATH"], "r+b") as f:
        by_path = mmap.mmap(f.fileno(), length, flags=mmap.MAP_SHARED)
    by_fd = mmap.mmap(int(env["POOLD_LEASE_FD"]), length, flags=mmap.MAP_SHARED)
    by_path[:5] = b"hello"
    by_path[length - 5:] = b"world"
    assert by_fd[:5] == b"hello" and by_fd[length - 5:] == b"world"  # one memory, two names
    print(env["POOLD_LEASE_ID"], env["POOLD_LEASE_PATH"], length, env["POOLD_LEASE_MEDIA"],
          env.get("POOLD_LEASE_NODE", "-"), flush=True)
    sys.exit(7)
"""


def test_cmd_maps_the_path_and_its_exit_releases_the_lease(cluster: Cluster) -> None:
    out = subprocess.run(
        poolrun_argv(cluster, "--size", "4MiB", "--", *cmd(MAPS_THE_PATH)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 7, out.stderr  # CMD's own status
    lease_id, path, length, media, _node = out.stdout.split()
    assert path.startswith("/proc/self/fd/") and int(length) == 4 * MIB
    assert media == "emulated"
    assert cluster.wait_state(lease_id, "released") == "released"
    assert cluster.admin.status().leased_bytes == 0


def test_signals_are_forwarded_and_death_by_signal_is_128_plus_n(cluster: Cluster) -> None:
    script = """
        import signal, sys, time
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
        print("ready", flush=True)
        while not got:
            time.sleep(0.01)
        print("usr1", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(60)
    """
    proc = subprocess.Popen(
        poolrun_argv(cluster, "--size", "2MiB", "--", *cmd(script)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_line(proc) == "ready"
        proc.send_signal(signal.SIGUSR1)
        assert wait_line(proc) == "usr1"
        proc.send_signal(signal.SIGTERM)  # forwarded; CMD dies of it
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert cluster.admin.status().leased_bytes == 0


def test_revocation_signals_cmd_before_the_deadline(cluster: Cluster) -> None:
    script = """
        import os, signal, sys, time
        from datetime import UTC, datetime
        told = []
        signal.signal(signal.SIGUSR2, lambda s, f: told.append(datetime.now(UTC)))
        print(os.environ["POOLD_LEASE_ID"], flush=True)
        while not told:
            time.sleep(0.01)
        print(told[0].isoformat(), flush=True)
        sys.exit(0)  # moved its blocks away: done
    """
    proc = subprocess.Popen(
        poolrun_argv(
            cluster, "--size", "2MiB", "--ttl", "3", "--revoke-signal", "USR2", "--", *cmd(script)
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lease_id = wait_line(proc)
        revoked_at = datetime.now(UTC)
        cluster.admin.revoke(lease_id, reason="failing DIMM", deadline_s=8)
        told_at = datetime.fromisoformat(wait_line(proc))
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert (told_at - revoked_at).total_seconds() < 8  # before the memory goes
    assert cluster.wait_state(lease_id, "reclaimed") == "reclaimed"


def test_poolrun_killed_leaves_a_lease_the_agent_orphans_and_reclaims(
    cluster: Cluster, tmp_path: Path
) -> None:
    done = tmp_path / "cmd-ended"
    script = f"""
        import os, signal, sys, time
        def ended(s, f):
            # written then renamed: the test polls for the name, so it must
            # never see the file before its content
            with open({str(done)!r} + ".tmp", "w") as out:
                out.write(str(s))
            os.rename({str(done)!r} + ".tmp", {str(done)!r})
            sys.exit(0)
        signal.signal(signal.SIGTERM, ended)
        print(os.environ["POOLD_LEASE_ID"], os.getpid(), flush=True)
        time.sleep(60)
    """
    proc = subprocess.Popen(
        poolrun_argv(cluster, "--size", "2MiB", "--", *cmd(script)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lease_id, _pid = wait_line(proc).split()
        proc.kill()  # SIGKILL: no release, no goodbye
        proc.wait(10)
        deadline = time.monotonic() + 10
        while not done.exists():  # the kernel told CMD its parent died
            assert time.monotonic() < deadline, "CMD outlived poolrun"
            time.sleep(0.05)
        assert done.read_text() == str(int(signal.SIGTERM))
    finally:
        assert proc.stdout is not None
        proc.stdout.close()
    assert cluster.wait_state(lease_id, "orphaned") in ("orphaned", "reclaimed")
    assert cluster.wait_state(lease_id, "reclaimed") == "reclaimed"
    assert cluster.admin.status().leased_bytes == 0


def test_no_lease_is_125_and_a_missing_command_127(cluster: Cluster) -> None:
    out = subprocess.run(
        poolrun_argv(cluster, "--size", "1GiB", "--", "true"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == poolrun.EXIT_POOLRUN_FAILED
    assert "quota_exceeded" in out.stderr or "no_capacity" in out.stderr, out.stderr
    out = subprocess.run(
        poolrun_argv(cluster, "--size", "2MiB", "--", "/nonexistent/engine"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == poolrun.EXIT_NOT_FOUND, out.stderr
    assert cluster.admin.status().leased_bytes == 0


def test_signal_names_and_statuses() -> None:
    assert poolrun.parse_signal("term") is signal.SIGTERM
    assert poolrun.parse_signal("SIGUSR2") is signal.SIGUSR2
    assert poolrun.parse_signal("10") is signal.Signals(10)
    assert poolrun.exit_status(-9) == 137 and poolrun.exit_status(3) == 3
    assert os.environ.get("POOLD_LEASE_PATH") is None  # the tests' own env is untouched


PINS_THE_MAPPING = """
    import ctypes, mmap, os, sys
    env = os.environ
    length = int(env["POOLD_LEASE_BYTES"])
    with open(env["POOLD_LEASE_PATH"], "r+b") as f:
        mm = mmap.mmap(f.fileno(), length, flags=mmap.MAP_SHARED)
    buf = (ctypes.c_char * length).from_buffer(mm)
    libc = ctypes.CDLL(None, use_errno=True)
    # What cudaHostRegister / ibv_reg_mr do first: pin every page of the shared mapping.
    assert libc.mlock(buf, ctypes.c_size_t(length)) == 0, os.strerror(ctypes.get_errno())
    smaps = open("/proc/self/smaps").read().split("\\n")
    for i, line in enumerate(smaps):
        if line.startswith(f"{ctypes.addressof(buf):x}-"):
            fields = dict(l.split(":", 1) for l in smaps[i + 1 : i + 24] if ":" in l)
            break
    print(env["POOLD_LEASE_POPULATED"], env["POOLD_LEASE_PAGE_BYTES"],
          env.get("POOLD_LEASE_NODE", "-"), fields["Locked"].split()[0],
          fields["KernelPageSize"].split()[0], "s" in line.split()[1], flush=True)
    libc.munlock(buf, ctypes.c_size_t(length))
    del buf
    mm.close()
"""


def test_populated_lease_on_a_node_maps_shared_and_pins(cluster: Cluster) -> None:
    out = subprocess.run(
        poolrun_argv(
            cluster,
            "--size",
            "8MiB",
            "--populate",
            "--hugepages",
            "prefer",
            "--node",
            "0",
            "--",
            *cmd(PINS_THE_MAPPING),
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    populated, page_bytes, node, locked_kib, kernel_page_kib, shared = out.stdout.split()
    assert populated == "1" and node == "0" and shared == "True"
    assert int(locked_kib) == 8 * 1024  # every page pinned
    assert int(page_bytes) == int(kernel_page_kib) * 1024  # the page size reported is real


def test_unpopulated_lease_says_so_and_an_absent_node_is_refused(cluster: Cluster) -> None:
    from agent.client import PoolClient
    from poold.errors import BackendFailed

    with PoolClient(cluster.socket_path) as client:
        plain = client.lease("2MiB")
        assert not plain.populated and plain.page_size_bytes == os.sysconf("SC_PAGE_SIZE")
        plain.release()
        populated = client.lease("2MiB", populate=True, hugepages="off")
        assert populated.populated
        populated.release()
        with pytest.raises(BackendFailed):  # a node this host lacks
            client.lease("2MiB", numa_node=999)
    assert cluster.admin.status().leased_bytes == 0


def hugepages_pool(pages: int) -> int | None:
    """Grow the host's 2 MiB pool by ``pages``; the old size, or None when not allowed."""
    path = Path("/proc/sys/vm/nr_hugepages")
    try:
        old = int(path.read_text())
        path.write_text(str(old + pages))
    except OSError:
        return None
    if int(path.read_text()) < old + pages:
        path.write_text(str(old))
        return None
    return old


def test_required_hugepages_come_from_the_pool_or_fail(cluster: Cluster) -> None:
    from agent.client import PoolClient
    from poold.errors import BackendFailed

    with PoolClient(cluster.socket_path) as client:
        old = hugepages_pool(4)
        if old is None:
            # Without a pool: required fails, prefer falls back to base pages.
            with pytest.raises(BackendFailed):
                client.lease("8MiB", hugepages="required")
            lease = client.lease("8MiB", hugepages="prefer")
            assert lease.page_size_bytes == os.sysconf("SC_PAGE_SIZE")
            lease.release()
            return
        try:
            lease = client.lease("8MiB", hugepages="required", populate=True)
            assert lease.page_size_bytes == 2 << 20 and lease.populated
            mm = lease.mmap()
            mm[:4] = b"huge"
            assert mm[:4] == b"huge"
            mm.close()
            lease.release()
        finally:
            Path("/proc/sys/vm/nr_hugepages").write_text(str(old))
