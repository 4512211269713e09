"""`poolctl top` against a real poold: frames, rates between them, and a clean Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import cli.top
from cli.poolctl import main
from cli.top import Snapshot, frame
from poold.api.client import PooldClient
from tests.cli.test_lifecycle import agent, lease
from tests.conftest import ADMIN_TOKEN, ThreadedServer

__all__ = ["agent"]  # the fixture, shared with the lifecycle commands' tests

ROOT = Path(__file__).resolve().parents[2]


def poolctl(api: ThreadedServer, *args: str) -> Result:
    return CliRunner().invoke(
        main, ["--url", api.url, "--token", ADMIN_TOKEN, *args], env={"COLUMNS": "200"}
    )


def test_json_frames_and_rates(
    api: ThreadedServer, agent: PooldClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = lease(agent)
    changes = iter([lambda: lease(agent), lambda: agent.release(first)])

    def between_frames(_s: float) -> None:
        next(changes)()  # a grant before frame 2, a release before frame 3

    monkeypatch.setattr(cli.top, "sleep", between_frames)
    r = poolctl(api, "top", "--json", "--iterations", "3", "--interval", "0.1")
    assert r.exit_code == 0, r.output
    frames = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(frames) == 3
    assert [(f["granted"], f["ended"], f["live_leases"]) for f in frames] == [
        (None, None, 1),
        (1, 0, 2),
        (0, 1, 1),
    ]
    assert frames[1]["granted_per_s"] > 0 and frames[0]["granted_per_s"] is None
    (dev,) = frames[1]["devices"]
    assert dev["uid"] == "h1/numa:node3" and dev["live_leases"] == 2
    assert frames[1]["tenants"] == [{"tenant": "t1", "live_leases": 2, "leased_bytes": 16 << 20}]


def test_plain_frames_show_draining(api: ThreadedServer, agent: PooldClient) -> None:
    lease(agent)
    assert poolctl(api, "hosts", "drain", "h1").exit_code == 0
    r = poolctl(api, "top", "--iterations", "2", "--interval", "0.1")
    assert r.exit_code == 0, r.output
    assert r.output.count("poolctl top ") == 2
    assert "draining: hosts h1" in r.output
    assert "h1/numa:node3" in r.output and "t1" in r.output
    assert "granted 0 (0." in r.output  # the second frame has rates


def test_table_mode_runs_live(api: ThreadedServer, agent: PooldClient) -> None:
    r = poolctl(api, "--format", "table", "top", "--iterations", "2", "--interval", "0.1")
    assert r.exit_code == 0, r.output
    assert "live leases per tenant" in r.output


def test_ctrl_c_ends_top_cleanly(
    api: ThreadedServer, agent: PooldClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(_s: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.top, "sleep", interrupted)
    for fmt in ("plain", "table", "json"):
        r = poolctl(api, "--format", fmt, "top", "--interval", "5")
        assert r.exit_code == 0, r.output
        assert r.stderr == ""


def test_sigint_to_a_real_process_exits_0(api: ThreadedServer, agent: PooldClient) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "POOLD_TOKEN")}
    args = ["--url", api.url, "--token", ADMIN_TOKEN, "top", "--json", "--interval", "0.2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert proc.stdout is not None
        json.loads(proc.stdout.readline())  # the first frame is out: top is looping
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert err == ""


def test_frame_is_pure(api: ThreadedServer, agent: PooldClient, admin: PooldClient) -> None:
    a = lease(agent)
    before = Snapshot(10.0, admin.status(), admin.list_leases(live=True))
    agent.release(a)
    lease(agent)
    lease(agent)
    after = Snapshot(12.0, admin.status(), admin.list_leases(live=True))
    f = frame(before, after, datetime(2026, 1, 1, tzinfo=UTC))
    assert (f.granted, f.ended, f.interval_s) == (2, 1, 2.0)
    assert (f.granted_per_s, f.ended_per_s) == (1.0, 0.5)
    assert f.at == "2026-01-01T00:00:00+00:00" and f.live_leases == 2
    assert frame(None, after, datetime.now(UTC)).granted is None
