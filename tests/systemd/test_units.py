"""The unit files in systemd/ are valid, and the agent honours socket activation."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.client import PoolClient
from poold import procs

UNITS_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNITS = sorted(p for p in UNITS_DIR.iterdir() if p.suffix in (".service", ".socket", ".timer"))
CONSOLE_SCRIPTS = ("poold", "pool-agent", "poolctl")


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing in CI: install Debian's `systemd` package")
        pytest.skip("systemd-analyze not installed (Debian package `systemd`)")
    return found


def test_every_unit_is_there() -> None:
    names = {p.name for p in UNITS}
    assert names == {
        "poold.service",
        "pool-agent.service",
        "pool-agent.socket",
        "poolctl-audit.service",
        "poolctl-audit.timer",
    }


def test_units_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on all units together: no error and not one warning.

    verify also checks that ExecStart= binaries exist. Where poold is not
    installed system-wide (a checkout), the console scripts are stood in for by
    stubs in a temp dir; everything else is verified as written.
    """
    tool = systemd_analyze()
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in CONSOLE_SCRIPTS:
        stub = stubs / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    for unit in UNITS:
        text = unit.read_text()
        for name in CONSOLE_SCRIPTS:
            for prefix in ("/usr/bin/", "/usr/local/bin/"):
                if not Path(prefix + name).exists():
                    text = text.replace(prefix + name + " ", f"{stubs}/{name} ")
        assert "/home/" not in text and "/work/" not in text  # no machine-specific paths
        (tmp_path / unit.name).write_text(text)
    result = subprocess.run(
        [tool, "verify", *[unit.name for unit in UNITS]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "" and result.stdout.strip() == "", result.stderr


def test_units_say_what_the_design_asks() -> None:
    text = {p.name: p.read_text() for p in UNITS}
    sock = text["pool-agent.socket"]
    assert "ListenStream=/run/poold/agent.sock" in sock
    assert "SocketMode=0660" in sock and "SocketGroup=poold-tenants" in sock
    timer = text["poolctl-audit.timer"]
    assert "OnCalendar=hourly" in timer and "Persistent=true" in timer
    for name in ("poold.service", "pool-agent.service", "poolctl-audit.service"):
        for setting in (
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            "ProtectHome=yes",
            "PrivateTmp=yes",
        ):
            assert setting in text[name], (name, setting)
    assert "DeviceAllow=char-dax rw" in text["pool-agent.service"]
    assert "SuccessExitStatus=1" in text["poolctl-audit.service"]


@pytest.fixture
def poold_and_credential(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    state_dir = tmp_path / "poold"
    port = procs.free_port()
    poold = procs.start_poold(state_dir, port)
    try:
        with procs.admin_client(state_dir, port) as admin:
            credential = tmp_path / "credential"
            credential.write_text(admin.add_host("sa-host").credential)
        yield f"http://127.0.0.1:{port}", credential
    finally:
        poold.stop()


# The wrapper systemd would be: put the listening socket on fd 3, set LISTEN_PID to
# the pid that will run the agent (exec keeps it), LISTEN_FDS=1, and exec.
WRAPPER = """
import os, sys
fd = int(sys.argv[1])
os.dup2(fd, 3)
os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_FDNAMES"] = "pool-agent.socket"
os.execv(sys.executable, [sys.executable, "-m", "agent", *sys.argv[2:]])
"""


def test_agent_adopts_a_socket_activated_listener(
    tmp_path: Path, poold_and_credential: tuple[str, Path]
) -> None:
    url, credential = poold_and_credential
    run_dir = Path(tempfile.mkdtemp(prefix="poold-sa-"))
    try:
        path = run_dir / "agent.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o660)  # what SocketMode=0660 does
        listener.listen(16)
        inode = path.stat().st_ino
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRAPPER,
                str(listener.fileno()),
                "serve",
                "--host",
                "sa-host",
                "--poold-url",
                url,
                "--credential-file",
                str(credential),
                "--socket",
                str(path),
                "--state-dir",
                str(tmp_path / "agent"),
                "--emulated",
                "--emulated-capacity",
                str(64 << 20),
                "--heartbeat-interval",
                "0.5",
                "--log-level",
                "warning",
            ],
            pass_fds=(listener.fileno(),),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        listener.close()  # only the agent holds it now, as after systemd's exec
        try:
            # The socket listened before the agent ran: the connection waits in the
            # backlog until the agent adopts the listener and accepts it.
            with PoolClient(path, timeout_s=30) as client:
                hello = client.hello()
            assert hello.host == "sa-host"
            assert hello.peer_uid == os.getuid()
            assert child.poll() is None
            # Adopted, not re-bound: the very socket file systemd made, with its mode.
            assert path.stat().st_ino == inode
            assert oct(path.stat().st_mode & 0o777) == oct(0o660)
        finally:
            child.terminate()
            out, _ = child.communicate(timeout=15)
        assert child.returncode == 0, out.decode(errors="replace")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
