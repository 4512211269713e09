"""`poold serve` refusing to start: one coded line on stderr, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_ledger_that_cannot_be_opened_is_one_line(tmp_path: Path, backend: str) -> None:
    # A SQLite file in a directory that does not exist; a PostgreSQL nobody listens for.
    url = (
        f"sqlite:///{tmp_path / 'no-such-dir' / 'ledger.db'}"
        if backend == "sqlite"
        else f"postgresql+psycopg://poold:s3cret@127.0.0.1:{free_port()}/poold"
    )
    argv = [sys.executable, "-m", "poold", "serve", "--state-dir", str(tmp_path / "state")]
    out = subprocess.run(
        [*argv, "--port", str(free_port()), "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("poold: error[ledger_unavailable]: cannot open the ledger at ")
    assert "s3cret" not in line and "Traceback" not in out.stderr
