"""How both daemons log: one setup for poold and pool-agent, text or JSON lines on stderr.

What an operator reads is the point: one INFO line per administrative change and per
lease state change worth a look, one WARNING per outage (not per failed request), and
routine traffic at DEBUG. So the chatty libraries are turned down here rather than in
the modules that use them: httpx logs every request at INFO (an agent's heartbeat is
one), alembic a line per migration step at every start, uvicorn its own banner.

Under systemd, stderr goes to the journal, which stamps every line itself: when
``JOURNAL_STREAM`` names the stream stderr is (sd_journal_stream_fd(3)), text lines
drop their timestamp and start with a ``<N>`` syslog priority, so ``journalctl -p
warning`` filters by our levels. JSON lines keep their ``ts``: whoever parses them may
not read them through the journal.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from datetime import UTC, datetime
from types import FrameType
from typing import Annotated, Any, Final, Literal, TextIO

from pydantic import BeforeValidator


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


# Both as settings fields: a level is accepted in any case (INFO, info), as before.
LogLevel = Annotated[
    Literal["debug", "info", "warning", "error", "critical"], BeforeValidator(_lower)
]
LogFormat = Annotated[Literal["text", "json"], BeforeValidator(_lower)]
LOG_FORMATS: Final = ("text", "json")
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")

# Libraries whose INFO is routine traffic: they speak only at WARNING unless the
# daemon runs at DEBUG, and httpcore (connection-level chatter) not even then.
_QUIET_UNLESS_DEBUG: Final = ("httpx", "alembic", "uvicorn")
_QUIET_ALWAYS: Final = ("httpcore",)

# syslog priorities (sd-daemon(3) prefixes) by logging level.
_PRIORITY: Final = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}

_TEXT_FORMAT: Final = "%(asctime)s %(name)s %(levelname)s %(message)s"
_JOURNAL_FORMAT: Final = "%(name)s %(levelname)s %(message)s"
_HANDLER_NAME: Final = "poold.logs"


def stderr_is_journal(stream: TextIO | None = None) -> bool:
    """True when ``JOURNAL_STREAM`` (``device:inode``) is the file behind stderr."""
    value = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError):  # no fd behind it (a test's captured stream)
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


class JournalFormatter(logging.Formatter):
    """Text without a timestamp, prefixed ``<N>`` so the journal records our level."""

    def __init__(self) -> None:
        super().__init__(_JOURNAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6)
        # Every line of a multi-line record (a traceback) carries the priority.
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def setup_logging(
    level: str = "info", log_format: str = "text", *, stream: TextIO | None = None
) -> logging.Handler:
    """Configure the root logger for a daemon; safe to call again (it replaces its handler)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; one of {', '.join(LOG_LEVELS)}")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r}; one of {', '.join(LOG_FORMATS)}")
    out = stream or sys.stderr
    handler = logging.StreamHandler(out)
    handler.set_name(_HANDLER_NAME)
    formatter: logging.Formatter
    if log_format == "json":
        formatter = JsonFormatter()
    elif stderr_is_journal(out):
        formatter = JournalFormatter()
    else:
        formatter = logging.Formatter(_TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == _HANDLER_NAME:  # ours from an earlier call; leave others be
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in _QUIET_UNLESS_DEBUG:
        logging.getLogger(name).setLevel(logging.DEBUG if numeric <= logging.DEBUG else "WARNING")
    for name in _QUIET_ALWAYS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return handler


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` logs every thread's stack, by thread name, in one record:
    what a stalled daemon waits on, asked without stopping it. (Call from the main
    thread.)

    A Python-level handler, run by the main thread between bytecodes, reading
    `sys._current_frames()` under the GIL. Not faulthandler's C-level dump: that walks
    other threads' frames while they run, and killed a busy daemon mid-dump here."""

    def dump(_signum: int, _frame: FrameType | None) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines: list[str] = []
        for ident, frame in sys._current_frames().items():
            lines.append(f"thread {names.get(ident, '?')} ({ident}), most recent call last:")
            lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
        logging.getLogger("poold.stacks").warning(
            "thread stacks on SIGUSR1 (%d threads):\n%s", len(names), "\n".join(lines)
        )

    signal.signal(signal.SIGUSR1, dump)
