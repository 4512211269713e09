"""One logging setup for both daemons: text or JSON, journald without timestamps, quiet libs."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from poold import procs
from poold.errors import Unauthorized, UnknownLease
from poold.logs import RefusalLog, setup_logging, stderr_is_journal


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    quiet = {name: logging.getLogger(name).level for name in ("httpx", "alembic", "uvicorn")}
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, old in quiet.items():
        logging.getLogger(name).setLevel(old)


def test_text_lines_carry_a_timestamp(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    logging.getLogger("poold.x").info("hello %s", "there")
    line = out.getvalue().strip()
    assert line.endswith("poold.x INFO hello there")
    assert line[:4].isdigit()  # 2025-...


def test_json_lines_parse(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("debug", "json", stream=out)
    logging.getLogger("poold.x").warning("a %d", 1)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("poold.y").exception("failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["level"] == "warning" and first["logger"] == "poold.x" and first["msg"] == "a 1"
    assert "ts" in first
    assert second["msg"] == "failed" and "RuntimeError: boom" in second["exc"]


def test_journal_stream_drops_the_timestamp_and_adds_priorities(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    with (tmp_path / "stderr").open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert stderr_is_journal(stream)
        setup_logging("info", "text", stream=stream)
        logging.getLogger("poold.x").warning("disk %s", "full")
        logging.getLogger("poold.x").info("fine")
    assert (tmp_path / "stderr").read_text().splitlines() == [
        "<4>poold.x WARNING disk full",
        "<6>poold.x INFO fine",
    ]
    # Another stream than the journal's (stderr redirected to a file): timestamps stay.
    with (tmp_path / "other").open("w") as other:
        assert not stderr_is_journal(other)
    monkeypatch.setenv("JOURNAL_STREAM", "garbage")
    assert not stderr_is_journal()


def test_library_chatter_is_quiet_unless_debug(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    logging.getLogger("httpx").info('HTTP Request: POST http://x/v1/heartbeat "200 OK"')
    logging.getLogger("alembic.runtime.migration").info("Running upgrade")
    logging.getLogger("httpx").warning("kept")
    assert out.getvalue().count("\n") == 1 and "kept" in out.getvalue()
    setup_logging("debug", "text", stream=out)
    logging.getLogger("httpx").info("now shown")
    assert "now shown" in out.getvalue()


def test_bad_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log level"):
        setup_logging("loud")
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "xml")


@contextlib.contextmanager
def daemons(
    tmp_path: Path,
    host: str,
    *,
    poold_extra: list[str] | None = None,
    agent_extra: list[str] | None = None,
    heartbeat_interval_s: float = 1.0,
) -> Iterator[tuple[procs.Child, procs.Child, int]]:
    """Real `poold serve` and `pool-agent serve` for ``host`` (emulated memory); yields
    (poold, agent, poold's port) and stops both, leaving their logs."""
    port = procs.free_port()
    state = tmp_path / "poold"
    poold = procs.start_poold(state, port, extra=poold_extra)
    sock_dir = Path(f"/tmp/pl-{os.getpid()}")
    agent: procs.Child | None = None
    try:
        with procs.admin_client(state, port) as admin:
            credential = tmp_path / "credential"
            credential.write_text(admin.add_host(host).credential)
        agent = procs.start_agent(
            tmp_path,
            host=host,
            poold_url=f"http://127.0.0.1:{port}",
            credential_file=credential,
            socket_path=sock_dir / "agent.sock",
            emulated_capacity_bytes=64 << 20,
            heartbeat_interval_s=heartbeat_interval_s,
            extra=agent_extra,
        )
        yield poold, agent, port
    finally:
        if agent is not None:
            agent.stop()
        poold.stop()
        for leftover in sock_dir.glob("*"):
            leftover.unlink()
        if sock_dir.exists():
            sock_dir.rmdir()


def test_real_daemons_at_info_log_no_library_noise(tmp_path: Path) -> None:
    """poold's start has no alembic lines; an agent's heartbeats add no line at all."""
    with daemons(
        tmp_path,
        "log-host",
        poold_extra=["--log-level", "info", "--log-format", "json"],
        agent_extra=["--log-level", "info"],
        heartbeat_interval_s=0.2,
    ) as (poold, agent, _port):
        time.sleep(2.5)  # a dozen heartbeats
        assert agent.alive() and poold.alive()
    poold_lines = poold.log_path.read_text().splitlines()
    records = [json.loads(line) for line in poold_lines]
    assert not [r for r in records if r["logger"].startswith(("alembic", "uvicorn", "httpx"))]
    assert any(r["msg"].startswith("poold listening on") for r in records)
    agent_lines = (tmp_path / "agent-log-host.log").read_text().splitlines()
    assert not [line for line in agent_lines if "HTTP Request" in line], agent_lines
    # Start, registration and shutdown: a handful of lines, none per heartbeat.
    assert len(agent_lines) < 12, agent_lines


def test_sigusr1_dumps_every_thread_and_the_daemons_go_on(tmp_path: Path) -> None:
    """`kill -USR1` on poold or an agent logs each thread's stack; both go on, busy or not."""
    with daemons(tmp_path, "usr1-host") as (poold, agent, port):
        frames = ((poold, "poold/server.py"), (agent, "agent/run.py"))  # main threads'

        def dumped(child: procs.Child, frame: str) -> bool:
            text = child.log_path.read_text(errors="replace")
            return "thread stacks on SIGUSR1" in text and frame in text

        for child, _ in frames:
            child.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(dumped(*f) for f in frames):
            time.sleep(0.1)
        assert poold.alive() and agent.alive()
        with procs.admin_client(tmp_path / "poold", port) as admin:
            assert admin.health() is not None  # still answering
    for child, frame in frames:
        assert dumped(child, frame), child.log_tail(60)


def test_refusals_are_summarised_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    refusals = RefusalLog(logging.getLogger("poold.api"), every_s=60, clock=lambda: now[0])
    err = Unauthorized("unknown agent credential")
    with caplog.at_level(logging.INFO, logger="poold.api"):
        for step in range(41):  # one every 0.75 s for 30 s
            now[0] = step * 0.75
            refusals.refused(err, "host h1")
        refusals.refused(UnknownLease("no lease 'x'"), "host h1")  # another code: its own line
        now[0] = 61.0
        refusals.refused(err, "host h1")  # the window closed: this one ends it, summarised
        now[0] = 200.0
        refusals.refused(err, "host h1")  # after a quiet window: a first again
        now[0] = 230.0
        refusals.refused(err, "host h1")
        refusals.refused(Unauthorized("unknown agent credential"), "host h2")
        now[0] = 300.0  # another caller's refusal flushes h1's window
        refusals.refused(err, "host h2")
    assert [r.getMessage() for r in caplog.records] == [
        "refused: unauthorized (host h1): unknown agent credential",
        "refused: unknown_lease (host h1): no lease 'x'",
        "refused: unauthorized (host h1): 41 more in the last 61s, the latest: "
        "unknown agent credential",
        "refused: unauthorized (host h1): unknown agent credential",
        "refused: unauthorized (host h2): unknown agent credential",
        "refused: unauthorized (host h1): 1 more in the last 100s, the latest: "
        "unknown agent credential",
        "refused: unauthorized (host h2): unknown agent credential",
    ]
