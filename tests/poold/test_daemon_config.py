"""The daemons' own command lines refused as poolctl's are: one line,
`PROG: error[usage]: ...`, exit 2, never click's multi-line Usage:/Error: block."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "prog", "args", "words"),
    [
        ("poold", "poold", ["serve", "--port", "abc"], "'abc' is not a valid integer"),
        ("poold", "poold", ["serve", "--bogus"], "No such option '--bogus'"),
        ("poold", "poold", ["--nope"], "No such option '--nope'"),
        ("poold", "poold", ["config", "show", "--log-format", "xml"], "'xml' is not one of"),
        ("agent", "pool-agent", ["serve", "--bad"], "No such option '--bad'"),
        ("agent", "pool-agent", ["serve", "--heartbeat-interval", "x"], "not a valid float"),
        ("agent", "pool-agent", ["nosuchcommand"], "No such command 'nosuchcommand'"),
    ],
)
def test_a_refused_command_line_is_one_line_exit_2(
    module: str, prog: str, args: list[str], words: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and out.stdout == "", out
    [line] = out.stderr.splitlines()
    assert line.startswith(f"{prog}: error[usage]: ") and words in line, line
    assert line.endswith("--help')")


@pytest.mark.parametrize("module", ["poold", "agent"])
def test_help_and_version_still_exit_0(module: str) -> None:
    for args in (["--help"], ["--version"], ["serve", "--help"]):
        out = subprocess.run(
            [sys.executable, "-m", module, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0 and out.stderr == "" and out.stdout, (args, out)
