"""Does `poolctl audit --json` leave a readable answer when it cannot audit (poold down)?"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner, Result

from cli.poolctl import main
from tests.conftest import ThreadedServer, free_port

ROOT = Path(__file__).resolve().parents[2]


def audit(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"POOLD_TOKEN": None})


def json_error(r: Result, code: str) -> dict[str, object]:
    assert r.exit_code == 2, r.output
    body = json.loads(r.stdout)
    assert body.keys() == {"code", "message", "exit_code"}
    assert body["code"] == code and body["exit_code"] == 2
    (line,) = r.stderr.strip().splitlines()  # and the usual line, for cron's mail
    assert line == f"poolctl: error[{code}]: {body['message']}"
    return body


def test_poold_down_is_a_json_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    body = json_error(audit("--url", url, "--token", "t", "audit", "--json"), "poold_unreachable")
    assert url in str(body["message"])
    json_error(
        audit("--url", url, "--token", "t", "--format", "json", "audit"), "poold_unreachable"
    )


def test_no_token_is_a_json_error(tmp_path: Path) -> None:
    r = audit("--token-file", str(tmp_path / "none"), "audit", "--json", "--reclaim")
    assert str(json_error(r, "unauthorized")["message"]).startswith("no admin token")


def test_a_refused_token_is_a_json_error(api: ThreadedServer) -> None:
    r = audit("--url", api.url, "--token", "wrong", "audit", "--json")
    assert "refused the admin token" in str(json_error(r, "unauthorized")["message"])


def test_without_json_it_is_one_line_and_exit_2() -> None:
    r = audit("--url", f"http://127.0.0.1:{free_port()}", "--token", "t", "audit")
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.startswith("poolctl: error[poold_unreachable]: ")


def test_the_cron_line_keeps_a_readable_file(tmp_path: Path) -> None:
    """`poolctl audit --json > file` with poold down, as cron runs it."""
    out = tmp_path / "audit.json"
    env = {k: v for k, v in os.environ.items() if k != "POOLD_TOKEN"}
    url = f"http://127.0.0.1:{free_port()}"
    with out.open("w") as fh:
        rc = subprocess.run(
            [sys.executable, "-m", "cli", "--url", url, "--token", "t", "audit", "--json"],
            stdout=fh,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            timeout=60,
            check=False,
        ).returncode
    assert rc == 2
    body = json.loads(out.read_text())
    assert body["code"] == "poold_unreachable" and body["exit_code"] == 2
