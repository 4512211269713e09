"""`poold demo`: the whole system on one machine, no root, no far memory needed.

poold on SQLite in a temporary state directory, one agent (emulated device
when the host has no far memory), and a sample tenant that leases memory,
writes a pattern, reads it back, renews and releases; then a status table.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from poold import procs
from poold.wire.admin import TenantSpec

console = Console(highlight=False)


def step(text: str) -> None:
    console.print(f"[bold cyan]==>[/] {text}")


def _poolctl(port: int, state_dir: Path, *args: str) -> None:
    # Piped output would shrink rich's tables to 80 columns; the demo is read by people.
    columns = os.environ.get("COLUMNS", "140") if sys.stdout.isatty() else "140"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "--url",
            f"http://127.0.0.1:{port}",
            "--token-file",
            str(state_dir / "admin.token"),
            *args,
        ],
        check=True,
        env={**os.environ, "COLUMNS": columns},
    )


def run_demo(size_mib: int = 64, keep: bool = False) -> int:
    work = Path(tempfile.mkdtemp(prefix="poold-demo-"))
    state_dir = work / "poold"
    port = procs.free_port()
    children: list[procs.Child] = []
    try:
        step(f"starting poold on 127.0.0.1:{port}, SQLite ledger in {state_dir}")
        poold = procs.start_poold(state_dir, port)
        children.append(poold)
        admin = procs.admin_client(state_dir, port)
        host = "demo-host"
        step(f"adding host {host!r} and tenant 'demo' (uid {os.getuid()}, quota 1 GiB)")
        created = admin.add_host(host)
        cred = work / "agent.credential"
        cred.write_text(created.credential + "\n")
        cred.chmod(0o600)
        admin.create_tenant(
            TenantSpec(
                name="demo", quota_bytes=1 << 30, quota_leases=16, allowed_uids=[os.getuid()]
            )
        )
        sock = work / "agent.sock"
        step("starting pool-agent (emulated far memory: a memfd on ordinary RAM)")
        agent = procs.start_agent(
            work,
            host=host,
            poold_url=f"http://127.0.0.1:{port}",
            credential_file=cred,
            socket_path=sock,
            emulated_capacity_bytes=1 << 30,
            heartbeat_interval_s=0.5,
        )
        children.append(agent)
        ok = _tenant(sock, size_mib, admin)
        ok = _kv_engine(sock) and ok
        step("exclusive-copy accounting (poolctl accounting --by tenant)")
        _poolctl(port, state_dir, "accounting", "--by", "tenant")
        step("pool status (poolctl status)")
        _poolctl(port, state_dir, "status")
        step("lease history (poolctl leases list)")
        _poolctl(port, state_dir, "leases", "list")
        admin.close()
        step("stopping agent and poold")
        for child in reversed(children):
            child.stop()
        children.clear()
        console.print(
            "[bold green]demo finished: full lease cycle OK[/]"
            if ok
            else "[bold red]demo FAILED[/]"
        )
        return 0 if ok else 1
    finally:
        for child in reversed(children):
            child.kill()
        if keep:
            console.print(f"state kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _kv_engine(sock: Path) -> bool:
    """examples/kv_engine.py as a second tenant process, when this is a source checkout."""
    example = Path(__file__).resolve().parent.parent / "examples" / "kv_engine.py"
    if not example.is_file():
        step("examples/kv_engine.py is not here (installed package): KV engine skipped")
        return True
    step(
        "KV engine (examples/kv_engine.py): multi-turn sessions on a shrinkable lease, "
        "then pressure gives memory back, replicas first"
    )
    proc = subprocess.run(
        [sys.executable, str(example), "--socket", str(sock), "--mib", "32", "--steps", "120"],
        check=False,
    )
    return proc.returncode == 0


def _tenant(sock: Path, size_mib: int, admin: object) -> bool:
    from agent.client import PoolClient
    from poold.api.client import PooldClient

    assert isinstance(admin, PooldClient)
    size = size_mib << 20
    with PoolClient(sock) as client:
        hello = client.hello()
        step(
            f"tenant connected: agent on {hello.host} sees uid {hello.peer_uid} "
            f"pid {hello.peer_pid} (SO_PEERCRED)"
        )
        with client.lease(size, ttl_s=30) as lease:
            step(
                f"leased {lease.lease_id}: {size_mib} MiB, backend {lease.backend}, "
                f"media {lease.media}, device {lease.device_uid}, epoch {lease.epoch}, "
                f"fd {lease.fd}"
            )
            mm = lease.mmap()
            try:
                step(
                    "fresh memory reads as zeros: "
                    + str(mm[:4096] == bytes(4096) and mm[-4096:] == bytes(4096))
                )
                pattern = bytes(range(256)) * 4096  # 1 MiB
                t0 = time.perf_counter()
                for off in range(0, size, len(pattern)):
                    mm[off : off + len(pattern)] = pattern
                ok = all(
                    mm[off : off + len(pattern)] == pattern for off in range(0, size, len(pattern))
                )
                dt = time.perf_counter() - t0
                step(
                    f"wrote and read back a {size_mib} MiB pattern in {dt * 1000:.1f} ms: "
                    + ("OK" if ok else "MISMATCH")
                )
            finally:
                mm.close()
            renewed = lease.renew()
            step(f"renewed: expires at {renewed.isoformat(timespec='seconds')}")
            shown = admin.show_lease(lease.lease_id)
            step(
                f"ledger says: {shown.state}, {shown.length_bytes} bytes at offset "
                f"{shown.offset_bytes} of {shown.device_uid}"
            )
            lease_id = lease.lease_id
        step(f"released {lease_id}")
    deadline = time.monotonic() + 10
    state = ""
    while time.monotonic() < deadline:
        state = admin.show_lease(lease_id).state
        if state == "released":
            break
        time.sleep(0.05)
    step(f"ledger says: {state}")
    return ok and state == "released"
