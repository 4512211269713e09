"""A throwaway PostgreSQL server for the suite, from the Debian binaries on the machine.

CI runs as root and PostgreSQL refuses to: as root the server runs as the
`postgres` user. It listens on 127.0.0.1 only, with fsync off (test data is
disposable).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


def find_bindir() -> Path | None:
    override = os.environ.get("POOLD_TEST_PG_BINDIR")
    if override:
        return Path(override)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgServer:
    bindir: Path
    root: Path
    port: int
    user: str | None  # unix user the server runs as (None: the current one)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            check=True,
            capture_output=True,
            user=self.user,
            group=self.user,
            cwd=self.root,
        )

    def start(self) -> None:
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )
        self.resume()

    def resume(self) -> None:
        """Start the server on its existing data directory (after `pause`)."""
        opts = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.root} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            opts,
            "-l",
            str(self.root / "log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def pause(self) -> None:
        """Stop the server as `systemctl stop` would (`-m fast`: clients cut off, every
        commit written, since `synchronous_commit=off` loses the last ones on a crash),
        keeping its data for `resume`."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def start_server() -> PgServer:
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError("no PostgreSQL binaries (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="poold-pg-"))
    user = None
    if os.geteuid() == 0:
        user = "postgres"
        shutil.chown(root, user, user)
    server = PgServer(bindir=bindir, root=root, port=_free_port(), user=user)
    server.start()
    return server
