"""The release check (agent/release_check.py): the kernel, not a /proc scan, says that no
process holds a released memfd, and every way of still holding one is still caught.

The holders are real processes (``python -c`` children, a uid of their own where the
mode matters) handed the tenant's fd over SCM_RIGHTS; the kernel is this machine's. The
service-level tests go through a real AgentServer socket and a real poold.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agent import after_reply, holders
from agent import protocol as p
from agent.backends.emulated import EmulatedBackend, MemfdMaterialised, OnceFd
from agent.client import PoolClient
from agent.held import HeldLease
from agent.lease import Lease
from agent.peer import Peer
from agent.release_check import PUNCH, ReleaseCheck, data_ranges, recyclable, self_test, zero
from agent.service import AgentService
from agent.warm import MAX_PER_LENGTH, PER_LENGTH, WarmPool
from poold.api.client import PooldClient
from tests.agent.conftest import emulated_device, linked_agent, serving
from tests.conftest import ThreadedServer

MIB = 1 << 20
NOBODY = 65534

VERDICT = self_test()
needs_check = pytest.mark.skipif(VERDICT is not None, reason=f"not on this kernel: {VERDICT}")

# A holder: gets the memfd on fd 3 (SCM_RIGHTS), holds it as told, says "ready" with what
# it saw, then waits for a line on stdin and, for "opath", tries to reopen it after.
HOLDER = textwrap.dedent(
    """
    import ctypes, json, os, socket, sys
    how = sys.argv[1]
    sock = socket.socket(fileno=3)
    _, (fd,), _, _ = socket.recv_fds(sock, 8, 1)
    kept = []
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    if how in ("map", "private"):  # a bare mapping (Python's mmap would keep a dup fd)
        flags = 1 if how == "map" else 2  # MAP_SHARED, MAP_PRIVATE
        address = libc.mmap(None, 2 << 20, 3, flags, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value)
        ctypes.memset(address, 1, 2)
        os.close(fd)
    elif how == "keep":  # a dummy on fd 3; the real one arrives on fd 4 after "ready"
        os.close(fd)
    elif how == "reopen_ro":
        kept.append(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDONLY)); os.close(fd)
    elif how == "opath":
        kept.append(os.open(f"/proc/self/fd/{fd}", os.O_PATH)); os.close(fd)
    elif how == "pass":
        other = socket.socket(fileno=4)
        socket.send_fds(other, [b"x"], [fd]); os.close(fd)
    elif how == "nothing":
        os.close(fd)
    elif how != "fd":
        raise SystemExit(how)
    print(json.dumps({"ready": how}), flush=True)
    sys.stdin.readline()
    said = {}
    if how == "keep":
        _, (got,), _, _ = socket.recv_fds(socket.socket(fileno=4), 8, 1)
        kept.append(got)
        said["kept"] = True
    if how == "opath":
        said["blocks"] = os.fstat(kept[0]).st_blocks
        try:
            os.close(os.open(f"/proc/self/fd/{kept[0]}", os.O_RDWR))
            said["reopened"] = True
        except PermissionError:
            said["reopened"] = False
    print(json.dumps(said), flush=True)
    sys.stdin.readline()
    """
)


@dataclass
class Holder:
    proc: subprocess.Popen[str]

    def next(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the holder exited ({self.proc.wait()})"
        msg: dict[str, object] = json.loads(line)
        return msg

    def tell(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def hold(
    fd: int, how: str, *, uid: int | None = None, extra: socket.socket | None = None
) -> Holder:
    """A child process of ``uid`` (default: ours) holding ``fd`` as ``how`` says."""
    ours, theirs = socket.socketpair()
    fds = {3: theirs.fileno()}
    if extra is not None:
        fds[4] = extra.fileno()
    # Each inheritable fd goes to its number with a shell-free dup2 in the child.
    # Another uid may not reach this venv's interpreter: the holder needs the stdlib only.
    python = sys.executable if uid is None else (shutil.which("python3", path="/usr/bin:/bin"))
    if python is None:
        pytest.skip("no system python3 for a holder of another uid")
    proc = subprocess.Popen(
        [python, "-c", _dup_then(fds) + HOLDER, how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=tuple(fds.values()),
        user=uid,
        group=uid,
        extra_groups=[] if uid is not None else None,
    )
    theirs.close()
    socket.send_fds(ours, [b"m"], [fd])
    ours.close()
    holder = Holder(proc)
    assert holder.next() == {"ready": how}
    return holder


def _dup_then(fds: dict[int, int]) -> str:
    moves = "".join(f"os.dup2({src}, {dst}); " for dst, src in sorted(fds.items()) if src != dst)
    return f"import os; {moves}\n"


@pytest.fixture
def handed() -> Iterator[tuple[ReleaseCheck, MemfdMaterialised]]:
    """A 2 MiB memfd made as for a lease and handed out (the tenant's reopen and the probe)."""
    check = ReleaseCheck.for_this_kernel()
    memory = check.prepare(EmulatedBackend().materialise(2 * MIB, "test-release-check"))
    assert isinstance(memory, MemfdMaterialised)
    assert memory.tenant is not None and memory.probe is not None
    yield check, memory
    if memory.probe is not None and memory.probe.fd is not None:
        check.unheld(memory)  # closes whatever is left (never twice: fd numbers are reused)


@needs_check
def test_the_tenant_gets_a_reopen_of_the_same_memfd(
    handed: tuple[ReleaseCheck, MemfdMaterialised],
) -> None:
    _check, memory = handed
    assert memory.tenant is not None and memory.tenant.fd is not None
    tenant = os.fstat(memory.tenant.fd)
    assert (tenant.st_dev, tenant.st_ino) == (
        os.fstat(memory.fd).st_dev,
        os.fstat(memory.fd).st_ino,
    )
    assert tenant.st_size == 2 * MIB
    with mmap.mmap(memory.tenant.fd, 2 * MIB) as mm:  # read-write, as before
        mm[:2] = b"ok"


@needs_check
def test_nothing_held_is_answered_without_a_scan(
    handed: tuple[ReleaseCheck, MemfdMaterialised],
) -> None:
    check, memory = handed
    assert memory.tenant is not None and memory.tenant.fd is not None
    holder = hold(memory.tenant.fd, "nothing")
    try:
        assert check.unheld(memory) is True
        assert (check.fast, check.scanned) == (1, 0)
    finally:
        holder.end()


@needs_check
@pytest.mark.parametrize("how", ["map", "private", "fd", "reopen_ro"])
def test_a_holder_keeps_the_bytes_counted(
    handed: tuple[ReleaseCheck, MemfdMaterialised], how: str
) -> None:
    """A mapping (shared or private, its fd closed), the fd itself, a read-only reopen
    through /proc/<pid>/fd: each is seen, and the caller must scan."""
    check, memory = handed
    assert memory.tenant is not None and memory.tenant.fd is not None
    holder = hold(memory.tenant.fd, how, uid=NOBODY if os.geteuid() == 0 else None)
    try:
        assert check.unheld(memory) is False
        assert (check.fast, check.scanned) == (0, 1)
    finally:
        holder.end()


@needs_check
def test_an_fd_passed_on_to_another_process_is_seen(
    handed: tuple[ReleaseCheck, MemfdMaterialised],
) -> None:
    check, memory = handed
    assert memory.tenant is not None and memory.tenant.fd is not None
    near, far = socket.socketpair()
    dummy = os.open(os.devnull, os.O_RDONLY)
    keeper = hold(dummy, "keep", extra=near)
    os.close(dummy)
    passer = hold(memory.tenant.fd, "pass", extra=far)
    near.close()
    far.close()
    try:
        passer.end()  # the tenant is gone; only the keeper has the memfd now
        keeper.tell()
        assert keeper.next() == {"kept": True}
        assert check.unheld(memory) is False
    finally:
        keeper.end()


@needs_check
@pytest.mark.skipif(os.geteuid() != 0, reason="the holder drops to another uid: root")
def test_an_o_path_holder_keeps_no_pages_and_cannot_reopen(
    handed: tuple[ReleaseCheck, MemfdMaterialised],
) -> None:
    """O_PATH files are not counted, so the check punches the pages out and sets the mode
    to 0 while it holds the lease: the holder keeps an inode with nothing in it."""
    check, memory = handed
    assert memory.tenant is not None and memory.tenant.fd is not None
    with mmap.mmap(memory.tenant.fd, 2 * MIB) as mm:
        mm[:] = b"x" * (2 * MIB)  # every page allocated
    holder = hold(memory.tenant.fd, "opath", uid=NOBODY)
    try:
        assert check.unheld(memory) is True
        PUNCH.settle()  # the pages go off the request path
        holder.tell()
        assert holder.next() == {"blocks": 0, "reopened": False}
    finally:
        holder.end()


_SECCOMP_CHILD = textwrap.dedent(
    """
    import ctypes, json, struct
    F_SETLEASE, EINVAL, NR_FCNTL = 1024, 22, 72
    def stmt(code, k, jt=0, jf=0):
        return struct.pack("HBBI", code, jt, jf, k)
    prog = b"".join([
        stmt(0x20, 0),                        # ld [nr]
        stmt(0x15, NR_FCNTL, 0, 3),           # jeq fcntl
        stmt(0x20, 24),                       # ld [args[1] low word]
        stmt(0x15, F_SETLEASE, 0, 1),         # jeq F_SETLEASE
        stmt(0x06, 0x00050000 | EINVAL),      # ret ERRNO(EINVAL): as fs.leases-enable=0
        stmt(0x06, 0x7FFF0000),               # ret ALLOW
    ])
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    arg = ctypes.create_string_buffer(fprog)
    assert libc.prctl(22, 2, ctypes.addressof(arg), 0, 0) == 0, ctypes.get_errno()
    from agent.backends.emulated import EmulatedBackend
    from agent.release_check import ReleaseCheck
    check = ReleaseCheck.for_this_kernel()
    memory = check.prepare(EmulatedBackend().materialise(2 << 20, "t"))
    print(json.dumps({"usable": check.usable, "why": check.why,
                      "tenant": memory.tenant is not None, "unheld": check.unheld(memory)}))
    """
)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter names x86_64's fcntl")
def test_a_kernel_that_refuses_leases_falls_back_to_scanning() -> None:
    """The self-test decides: where F_SETLEASE fails (here EINVAL from a seccomp filter,
    as with fs.leases-enable=0), the tenant gets the agent's memfd and every release scans."""
    assert ctypes.sizeof(ctypes.c_void_p) == 8
    done = subprocess.run(
        [sys.executable, "-c", _SECCOMP_CHILD], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["usable"] is False and said["tenant"] is False and said["unheld"] is False
    assert "leases are off" in said["why"]
    assert "every release scans /proc" in done.stderr  # and the log says which


# --- through the agent's socket ---------------------------------------------------------


@pytest.fixture
def agent(api: ThreadedServer, admin: PooldClient) -> Iterator[tuple[PoolClient, AgentService]]:
    with (
        linked_agent(api.url, admin, emulated_device(256 * MIB), ["t"]) as linked,
        serving(linked.service) as path,
        PoolClient(path) as client,
    ):
        yield client, linked.service


@needs_check
def test_a_release_through_the_socket_takes_the_fast_path(
    agent: tuple[PoolClient, AgentService],
) -> None:
    client, service = agent
    check = service.memory.release_check
    for _ in range(3):
        lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
        with lease.mmap() as mm:
            mm[:4] = b"used"
        lease.release()
    assert (check.fast, check.scanned) == (3, 0)


@needs_check
def test_a_release_by_id_lets_go_of_the_clients_own_lease(
    agent: tuple[PoolClient, AgentService],
) -> None:
    """`PoolClient.release(id)` of a lease that client holds closes its fd and stops its
    renewals first, as `Lease.release()` does: the client's own fd is not a holder that
    keeps the bytes counted (`released_mapped`)."""
    client, service = agent
    check = service.memory.release_check
    for _ in range(3):
        lease = client.lease(2 * MIB, tenant="t", ttl_s=60)
        client.release(lease.lease_id)
        assert lease.released and client.leases == []
    assert (check.fast, check.scanned) == (3, 0)
    assert service.held.mapped() == []
    lease.release()  # and Lease.release() after it asks nothing more


@needs_check
def test_a_release_with_a_mapping_kept_is_released_mapped(
    agent: tuple[PoolClient, AgentService],
) -> None:
    client, service = agent
    check = service.memory.release_check
    lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
    kept = lease.mmap()  # Python's mmap keeps a dup of the fd, and the pages
    lease.release()
    [watched] = service.held.mapped()
    assert (watched.lease_id, watched.why, watched.pids) == (
        lease.lease_id,
        "released",
        {os.getpid()},
    )
    assert (check.fast, check.scanned) == (0, 1)
    kept.close()
    assert service.revocations.check_mapped() == 1


def test_with_the_check_off_every_release_scans_and_still_catches_a_mapping(
    api: ThreadedServer, admin: PooldClient
) -> None:
    with linked_agent(api.url, admin, emulated_device(256 * MIB), ["t"]) as linked:
        off = ReleaseCheck(False, "turned off by the test")
        linked.service.memory.release_check = off
        with serving(linked.service) as path, PoolClient(path) as client:
            kept_lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
            kept = kept_lease.mmap()
            kept_lease.release()
            assert [m.lease_id for m in linked.service.held.mapped()] == [kept_lease.lease_id]
            kept.close()
            assert linked.service.revocations.check_mapped() == 1
            lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
            lease.release()
            assert linked.service.held.get(lease.lease_id) is None
            assert linked.service.held.mapped() == []
            assert off.fast == 0


@needs_check
def test_warm_memfds_come_with_their_copies() -> None:
    """The warm pool's memfds are prepared on its own thread, off the lease path."""
    backend = EmulatedBackend()
    check = ReleaseCheck.for_this_kernel()
    backend.hand_out = check.prepare
    pool = WarmPool(backend)
    pool.start()
    try:
        memory = None
        deadline = time.monotonic() + 10
        while memory is None:
            assert time.monotonic() < deadline, "the warm pool made nothing"
            memory = pool.take(2 * MIB)
            time.sleep(0.01)
        assert isinstance(memory, MemfdMaterialised)
        assert memory.tenant is not None and memory.probe is not None
        assert check.prepare(memory) is memory  # nothing to open on the lease path
        assert check.unheld(memory) is True
    finally:
        pool.stop()  # the ready ones go with their copies


@needs_check
def test_a_shrunk_lease_still_takes_the_fast_path(
    agent: tuple[PoolClient, AgentService],
) -> None:
    client, service = agent
    lease = client.lease(8 * MIB, tenant="t", ttl_s=60, renew=False, shrinkable=True)
    with lease.mmap() as mm:
        mm[-1] = 1
    assert lease.shrink(4 * MIB) == 4 * MIB
    lease.release()
    assert service.memory.release_check.fast == 1
    assert service.held.mapped() == []


@needs_check
def test_the_agent_keeps_no_copy_of_the_tenants_reopen_once_sent(
    agent: tuple[PoolClient, AgentService],
) -> None:
    """Sent, the tenant's reopen is closed on the agent's side (the server's fd_sent
    hook): what the agent keeps is the memfd_create file and the read-only probe."""
    client, _service = agent
    lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
    inode = (os.fstat(lease.fd).st_dev, os.fstat(lease.fd).st_ino)
    modes = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == inode:
            modes.append(os.open(f"/proc/self/fdinfo/{name}", os.O_RDONLY))
    flags = []
    for fd in modes:
        with os.fdopen(fd) as info:
            flags.append(int(info.read().split("flags:")[1].split()[0], 8) & os.O_ACCMODE)
    # This process is the agent and the tenant: the tenant's fd, the agent's two.
    assert sorted(flags) == sorted([os.O_RDWR, os.O_RDWR, os.O_RDONLY]), flags
    lease.release()


@needs_check
def test_an_fd_left_in_a_socket_queue_keeps_the_bytes_counted(
    agent: tuple[PoolClient, AgentService],
) -> None:
    """An fd sent into a socket and not yet received is in no process's fd table, so a
    /proc scan alone finds nobody; the kernel still counts it, and the lease is watched
    until the fd is received and closed."""
    client, service = agent
    near, far = socket.socketpair()
    try:
        lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
        socket.send_fds(near, [b"x"], [lease.fd])
        lease.release()  # its own fd closed first, as always
        [watched] = service.held.mapped()
        assert (watched.lease_id, watched.pids) == (lease.lease_id, set())
        assert service.revocations.check_mapped() == 0  # still in the queue
        _, (fd,), _, _ = socket.recv_fds(far, 8, 1)
        assert service.revocations.check_mapped() == 0  # received: held by this process
        os.close(fd)
        assert service.revocations.check_mapped() == 1
        assert service.held.mapped() == []
    finally:
        near.close()
        far.close()


@needs_check
def test_a_lease_ended_twice_while_mapped_is_freed_once_the_mapping_goes(
    agent: tuple[PoolClient, AgentService],
) -> None:
    """A revocation's teardown and the tenant's release can both end one lease (each took
    it before the other let go). Watched twice, it must still be one watch with one probe:
    a probe left open is a file of the memfd in the agent's own fd table, so the lease
    would stay ``revoked_mapped`` for ever (seen in the 4-agent delegation run)."""
    client, service = agent
    lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
    kept = lease.mmap()
    held = service.held.get(lease.lease_id)
    assert held is not None and held.inode is not None
    inode = held.inode
    assert service.revocations.ended_mapped(held, "released")
    assert service.revocations.ended_mapped(held, "released")  # the other path, after
    [watched] = service.held.mapped()
    assert (watched.lease_id, watched.why) == (lease.lease_id, "released")
    lease.release()  # the client's own fd goes; the agent already ended the lease
    assert service.revocations.check_mapped() == 0  # the mapping is still there
    kept.close()
    assert service.revocations.check_mapped() == 1
    assert service.held.mapped() == []
    ours = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (inode.dev, inode.ino):
            ours.append(name)
    assert ours == [], "the agent still has a file of the ended lease's memfd"


# --- released memfds handed out again ---------------------------------------------------


@pytest.fixture
def warm_agent(
    api: ThreadedServer, admin: PooldClient
) -> Iterator[tuple[PoolClient, AgentService]]:
    """The agent as it runs: with a warm pool, which released memfds may go back to."""
    with (
        linked_agent(api.url, admin, emulated_device(256 * MIB), ["t"], warm=True) as linked,
        serving(linked.service) as path,
        PoolClient(path) as client,
    ):
        yield client, linked.service


def _inode(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _released_and_settled(service: AgentService, lease_id: str) -> None:
    PUNCH.settle()
    assert service.held.get(lease_id) is None


def _take_until(client: PoolClient, inode: tuple[int, int]) -> tuple[Lease, list[Lease]]:
    """Leases of 2 MiB until one is of ``inode`` (the warm pool may hand out a fresh memfd
    its refill thread made meanwhile first); that one, and the others taken on the way."""
    others: list[Lease] = []
    for _ in range(MAX_PER_LENGTH + 1):
        lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
        if _inode(lease.fd) == inode:
            return lease, others
        others.append(lease)
    for x in others:
        x.release()
    raise AssertionError("the released memfd was not handed out again")


def _warmed(client: PoolClient, service: AgentService) -> None:
    """Until the warm pool has a 2 MiB memfd ready: the first lease of a length is made on
    the request path (never recycled: it is no warm memfd), and asks for the refill."""
    assert service.warm is not None
    client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False).release()
    deadline = time.monotonic() + 10
    # Full: the refill is done, and a memfd released from here has the room it leaves.
    while service.warm.ready(2 * MIB) < PER_LENGTH:
        assert time.monotonic() < deadline, "the warm pool did not fill"
        time.sleep(0.01)


@needs_check
def test_a_released_memfd_is_handed_out_again_zeroed(
    warm_agent: tuple[PoolClient, AgentService],
) -> None:
    """Released and held by no one, a warm memfd is zeroed in place and is what the next
    lease of its length gets: the same inode, every byte zero, the seals and size kept."""
    client, service = warm_agent
    _warmed(client, service)
    first = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
    inode = _inode(first.fd)
    with first.mmap() as mm:
        mm[:] = b"\xa5" * (2 * MIB)
    first.release()
    _released_and_settled(service, first.lease_id)
    assert service.warm is not None and service.warm.recycled == 1
    second, others = _take_until(client, inode)
    try:
        for lease in [second, *others]:
            with lease.mmap() as mm:
                assert mm[:] == bytes(2 * MIB)
        assert os.fstat(second.fd).st_size == 2 * MIB
    finally:
        for lease in [second, *others]:
            lease.release()


@needs_check
@pytest.mark.parametrize("how", ["map", "fd"])
def test_a_memfd_held_at_release_is_never_handed_out_again(
    warm_agent: tuple[PoolClient, AgentService], how: str
) -> None:
    """A memfd someone else still holds (a mapping of another uid, an fd) is not zeroed
    under them nor given to anyone: the next leases get other memory."""
    client, service = warm_agent
    _warmed(client, service)
    lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
    inode = _inode(lease.fd)
    holder = hold(lease.fd, how, uid=NOBODY if os.geteuid() == 0 else None)
    try:
        lease.release()
        _released_and_settled(service, lease.lease_id)
        assert service.warm is not None and service.warm.recycled == 0
        assert service.memory.release_check.scanned == 1
        later = [client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False) for _ in range(10)]
        try:
            assert inode not in {_inode(x.fd) for x in later}
        finally:
            for x in later:
                x.release()
    finally:
        holder.end()


@needs_check
@pytest.mark.skipif(os.geteuid() != 0, reason="the holder drops to another uid: root")
def test_an_o_path_holder_cannot_reach_the_next_tenants_memory(
    warm_agent: tuple[PoolClient, AgentService],
) -> None:
    """An O_PATH file is not counted, so its inode may be handed out again; its holder can
    still not reopen it (mode 0) while another lease writes into it."""
    client, service = warm_agent
    _warmed(client, service)
    first = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
    holder = hold(first.fd, "opath", uid=NOBODY)
    try:
        inode = _inode(first.fd)
        first.release()
        _released_and_settled(service, first.lease_id)
        second, others = _take_until(client, inode)
        try:
            with second.mmap() as mm:
                mm[:6] = b"secret"
            holder.tell()
            said = holder.next()
            assert said["reopened"] is False
        finally:
            for lease in [second, *others]:
                lease.release()
    finally:
        holder.end()


def test_zero_overwrites_every_byte_of_any_length() -> None:
    """Past one pwritev's 1024 buffers, and a tail shorter than the zero buffer."""
    length = (1030 << 16) + 100
    fd = os.memfd_create("test-zero", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, length)
        with mmap.mmap(fd, length) as mm:
            mm[:] = b"\xff" * length
            assert zero(fd, length) is True
            assert mm[:] == bytes(length)
    finally:
        os.close(fd)


def test_zero_writes_only_the_pages_a_tenant_touched() -> None:
    """fallocate'd pages nobody touched are holes (they read as zeros): zeroing leaves
    them so, and overwrites exactly the pages that were written or faulted in."""
    page = mmap.PAGESIZE
    length = 2 * MIB
    fd = os.memfd_create("test-zero-touched", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, length)
        os.posix_fallocate(fd, 0, length)
        assert data_ranges(fd, length) == []
        with mmap.mmap(fd, length) as mm:
            mm[3 * page : 5 * page] = b"\xff" * (2 * page)
            assert mm[100 * page] == 0  # a read fault: data too (it cannot be told apart)
            mm[length - 1] = 7
            assert data_ranges(fd, length) == [
                (3 * page, 5 * page),
                (100 * page, 101 * page),
                (length - page, length),
            ]
            assert zero(fd, length) is True
            # pread serves a hole from the zero page, without making it data.
            assert os.pread(fd, length, 0) == bytes(length)
            assert data_ranges(fd, length) == [
                (3 * page, 5 * page),
                (100 * page, 101 * page),
                (length - page, length),
            ]
            assert mm[:] == bytes(length)
    finally:
        os.close(fd)


def test_an_untouched_memfd_is_zero_without_a_write() -> None:
    """A lease whose tenant never touched its memory costs no zeroing, and stays all
    holes, so its next release costs none either."""
    length = 2 * MIB
    fd = os.memfd_create("test-zero-untouched", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, length)
        os.posix_fallocate(fd, 0, length)
        blocks = os.fstat(fd).st_blocks
        for _ in range(2):
            assert zero(fd, length) is True
            assert data_ranges(fd, length) == []
        assert os.fstat(fd).st_blocks == blocks  # its pages kept
        assert os.pread(fd, length, 0) == bytes(length)
    finally:
        os.close(fd)


@needs_check
def test_only_a_memfd_as_the_warm_pool_makes_them_is_recycled() -> None:
    """Mode 0 (set by the release check), its length, the lease seals: anything else is
    punched and closed, not handed out again."""
    backend = EmulatedBackend()
    sealed = backend.materialise(2 * MIB, "test-recycle")
    shrinkable = backend.materialise(2 * MIB, "test-recycle", shrinkable=True)
    try:
        assert isinstance(sealed, MemfdMaterialised) and sealed.warm
        assert isinstance(shrinkable, MemfdMaterialised) and not shrinkable.warm
        assert recyclable(sealed.fd, 2 * MIB) is False  # mode still as made
        os.fchmod(sealed.fd, 0)
        os.fchmod(shrinkable.fd, 0)
        assert recyclable(sealed.fd, 2 * MIB) is True
        assert recyclable(sealed.fd, 4 * MIB) is False
        assert recyclable(shrinkable.fd, 2 * MIB) is False
    finally:
        backend.release(sealed)
        backend.release(shrinkable)


def test_the_warm_pool_keeps_a_released_memfd_only_where_it_has_room() -> None:
    backend = EmulatedBackend()
    pool = WarmPool(backend, max_total_bytes=4 * MIB)
    made = [backend.materialise(2 * MIB, "test-recycle") for _ in range(3)]
    try:
        assert pool.wants(2 * MIB) is False  # a length no one asked for
        assert pool.take(2 * MIB) is None  # asked now (the refill thread is not running)
        assert pool.wants(2 * MIB) is True
        assert pool.recycle(made[0]) and pool.recycle(made[1])
        assert pool.wants(2 * MIB) is False and pool.recycle(made[2]) is False  # the cap
        assert pool.take(2 * MIB) is made[1]  # the last returned first
    finally:
        pool.stop()
        backend.release(made[1])
        backend.release(made[2])


def test_a_promised_recycle_holds_its_room_and_stops_fresh_refills() -> None:
    """A released memfd on its way back counts as in the pool: a take meanwhile asks no
    fresh one for it, and a cancelled promise frees the room again."""
    backend = EmulatedBackend()
    pool = WarmPool(backend, max_total_bytes=4 * MIB)
    made = [backend.materialise(2 * MIB, "test-recycle") for _ in range(2)]
    try:
        assert pool.take(2 * MIB) is None  # asked now (the refill thread is not running)
        assert pool.promise(2 * MIB) and pool.promise(2 * MIB)
        assert pool.wants(2 * MIB) is False  # both slots of the byte cap are promised
        pool.unpromise(2 * MIB)
        assert pool.wants(2 * MIB) is True
        assert pool.recycle(made[0], promised=True)
        assert pool.wants(2 * MIB) is True  # the promise it kept is settled
        assert pool.recycle(made[1]) and pool.wants(2 * MIB) is False
    finally:
        pool.stop()


class _Counting:
    """A taker that records how it was settled, and on which thread it took the memfd
    (it never keeps it: the memfd is punched and closed, as for any other)."""

    def __init__(self) -> None:
        self.called: list[int] = []
        self.cancelled = 0
        self.took_on: int | None = None
        self.done = threading.Event()

    def __call__(self, fd: int) -> bool:
        self.called.append(fd)
        self.took_on = threading.get_ident()
        self.done.set()
        return False

    def cancel(self) -> None:
        self.cancelled += 1
        self.done.set()


@needs_check
def test_releases_past_the_punch_bound_free_their_own_memfd() -> None:
    """A punch thread that falls behind holds at most MAX_PENDING memfds: the release past
    that punches and closes its own (and cancels its recycle), so fds and pages never pile
    up unboundedly (seen under a profiler as the agent running out of fds)."""
    from agent.backends.emulated import OnceFd
    from agent.release_check import _Punch

    punch = _Punch()
    punch.MAX_PENDING = 2
    punch._thread = threading.current_thread()  # never started: everything queued waits
    fds: list[int] = []
    try:
        for _ in range(3):
            fd = os.memfd_create("test-bound", os.MFD_CLOEXEC)
            os.ftruncate(fd, 2 * MIB)
            os.posix_fallocate(fd, 0, 2 * MIB)
            fds.append(fd)
        probes = [OnceFd(os.dup(fd)) for fd in fds]
        takers = [_Counting() for _ in fds]
        for fd, probe, take in zip(fds, probes, takers, strict=True):
            punch.put(fd, probe, 2 * MIB, take)
        assert punch.inline == 1 and len(punch._todo) == 2
        # The third was punched and closed on this thread: its fd and probe are gone.
        assert probes[2].fd is None
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fds[2])
        assert takers[2].cancelled == 1 and takers[2].called == []
        assert punch._pending == 2 and punch._pending_bytes == 4 * MIB
    finally:
        while punch._todo:
            fd, probe, _, _ = punch._todo.popleft()
            os.close(fd)
            probe.close()


def test_misses_deepen_a_lengths_pool_up_to_its_cap() -> None:
    """Tenants leasing at once need more than PER_LENGTH ready: each miss of a length
    asked before deepens its pool by half of that, up to MAX_PER_LENGTH."""
    backend = EmulatedBackend()
    pool = WarmPool(backend, max_total_bytes=1 << 30)
    try:
        assert pool.take(2 * MIB) is None  # first asked: not yet a miss that deepens
        for _ in range(PER_LENGTH):
            assert pool.promise(2 * MIB)
        assert pool.wants(2 * MIB) is False  # PER_LENGTH promised: full
        for _ in range(100):
            assert pool.take(2 * MIB) is None  # misses (the refill thread is not running)
        room = 0
        while pool.promise(2 * MIB):
            room += 1
        assert PER_LENGTH + room == MAX_PER_LENGTH
    finally:
        pool.stop()


@pytest.mark.parametrize("touched", [False, True])
def test_a_release_with_nothing_to_zero_is_taken_back_after_its_reply(touched: bool) -> None:
    """Served on the socket (after_reply.serving): an untouched memfd goes back to the
    pool on the serving thread once the reply left; one with pages to zero goes to the
    punch thread, so that the next request does not wait for the write."""
    length = 2 * MIB
    made = EmulatedBackend().materialise(length, "test-after-reply")  # as the pool makes them
    fd = made.fd
    os.fchmod(fd, 0)  # as the release check leaves it
    if touched:
        os.pwrite(fd, b"x", 4096)
    probe = OnceFd(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC))
    taker = _Counting()
    assert recyclable(fd, length)
    with after_reply.serving():
        PUNCH.put(fd, probe, length, taker)
        assert taker.took_on is None  # never before the reply
    assert taker.done.wait(10)
    PUNCH.settle()
    if touched:
        assert taker.took_on is not None and taker.took_on != threading.get_ident()
    else:
        assert taker.took_on == threading.get_ident()
    assert probe.fd is None  # closed either way


@needs_check
def test_a_gone_holder_found_by_two_checks_at_once_is_ended_once(
    warm_agent: tuple[PoolClient, AgentService],
) -> None:
    """A tenant's disconnect and the holder watch may both find its process gone and end
    the same leases. The second must not judge the memfd by a scan of its own: by then
    the first gave it back to the warm pool, the agent's own files of it are the pool's,
    and the lease stayed ``orphaned_mapped`` for ever (the chaos test, trial 26)."""
    client, service = warm_agent
    _warmed(client, service)
    lease = client.lease(2 * MIB, tenant="t", ttl_s=60, renew=False)
    with lease.mmap() as mm:
        mm[:4] = b"used"
    held = service.held.get(lease.lease_id)
    assert held is not None
    held.holder = holders.Holder(pid=_exited_pid(), uid=os.getuid(), start_time=1.0)
    assert lease._claim_release()  # the holder is gone: so are its files (no release)
    lease._let_go()
    seen = [held]  # what each check found before either ended it
    assert service.revocations.check_holders(list(seen)) == 1
    PUNCH.settle()  # the memfd is back in the warm pool, the agent's own again
    assert service.revocations.check_holders(list(seen)) == 0
    assert service.held.mapped() == []
    assert service.held.get(lease.lease_id) is None


def _exited_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@needs_check
def test_a_lease_ended_before_its_reply_left_still_sends_its_own_memfd(
    warm_agent: tuple[PoolClient, AgentService], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease can end (its holder found gone, by the holder watch or another connection's
    disconnect) between being held and its reply leaving. The fd the reply carries is the
    sending path's own: still open, a file of the lease's memfd, which stays counted and
    out of the warm pool until that file is gone. (Sent from the lease's memory instead,
    it was the agent's own fd of a memfd being zeroed for the next tenant, or a number
    closed under the send.)"""
    client, service = warm_agent
    _warmed(client, service)
    assert service.warm is not None
    recycled = service.warm.recycled
    peer = Peer(connection_id=10_001, pid=_exited_pid(), uid=os.getuid(), gid=os.getgid())
    add = service.held.add

    def add_then_check(held: HeldLease) -> None:
        add(held)
        assert service.revocations.check_holders([held]) == 1  # the holder watch, just then

    monkeypatch.setattr(service.held, "add", add_then_check)
    result, fd = service.lease(peer, p.LeaseArgs(size_bytes=2 * MIB, tenant="t"))
    monkeypatch.undo()
    try:
        PUNCH.settle()
        [watched] = service.held.mapped()
        assert watched.lease_id == result.lease_id
        assert _inode(fd) == (watched.inode.dev, watched.inode.ino)
        assert service.warm.recycled == recycled
    finally:
        service.fd_sent(peer, fd)  # the reply left (to nobody): the agent's copy goes
    assert service.revocations.check_mapped() == 1
    assert service.held.mapped() == []
