"""poolrun's own failures: one line with a code and exit 125, never a status CMD could have.

These run poolrun as a process with stderr a pipe; none needs an agent (the ones that do
are in tests/e2e/test_poolrun.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent import poolrun


def run_poolrun(*args: str, socket: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "agent.poolrun"]
    if socket is not None:
        argv += ["--socket", str(socket)]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60, check=False)


def one_error_line(out: subprocess.CompletedProcess[str], code: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"poolrun: error[{code}]: "), out.stderr
    assert "Traceback" not in out.stderr and "Input should" not in out.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ["--size", "64gb", "--", "true"],
        ["--size", "1.5.3G", "--", "true"],
        ["--size", "-1", "--", "true"],
        ["--size", "0", "--", "true"],
        ["--size", "2PiB", "--", "true"],
        ["--size", "1M"],  # no CMD
        ["--", "true"],  # no --size
        ["--size", "1M", "--tenant", "bad name", "--", "true"],
        ["--size", "1M", "--media", "DDR5/x", "--", "true"],
        ["--size", "1M", "--log-level", "bogus", "--", "true"],
        ["--size", "1M", "--hugepages", "bogus", "--", "true"],
        ["--size", "1M", "--revoke-signal", "BOGUS", "--", "true"],
        ["--bogus"],
    ],
)
def test_a_refused_command_line_is_125_in_one_line(args: list[str], tmp_path: Path) -> None:
    # 2 (click's usage status) is a status CMD itself may exit with: poolrun's own
    # failures must be told apart from CMD's, as env(1) and timeout(1) do with 125.
    out = run_poolrun(*args, socket=tmp_path / "no-agent.sock")
    assert out.returncode == poolrun.EXIT_POOLRUN_FAILED, out.stderr
    one_error_line(out, "usage")


def test_no_agent_is_125_with_the_code_in_one_line(tmp_path: Path) -> None:
    out = run_poolrun("--size", "1M", "--", "true", socket=tmp_path / "no-agent.sock")
    assert out.returncode == poolrun.EXIT_POOLRUN_FAILED
    assert "cannot lease" in one_error_line(out, "agent_unreachable")


def test_version_and_help_exit_0() -> None:
    out = run_poolrun("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"poolrun {poolrun.__version__}"
    out = run_poolrun("--help")
    assert out.returncode == 0 and "POOLD_AGENT_SOCKET" in out.stdout
