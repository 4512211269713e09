"""How both daemons log: one setup for poold and pool-agent, text or JSON lines on stderr.

What an operator reads is the point: one INFO line per administrative change and per
lease state change worth a look, one WARNING per outage (not per failed request), a
caller's repeated refusals as one line and then a summary a minute (:class:`RefusalLog`),
and routine traffic at DEBUG (an agent's grant of a lease among them). So the chatty
libraries are turned down here rather than in the modules that use them: httpx logs
every request at INFO (an agent's heartbeat is one), alembic a line per migration step
at every start, uvicorn its own banner.

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
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from types import FrameType
from typing import Annotated, Any, Final, Literal, TextIO

from pydantic import BeforeValidator

from poold.errors import PoolError


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


REFUSAL_SUMMARY_EVERY_S = 60.0
_REFUSAL_KEYS_MAX = 4096  # callers remembered; past it the oldest windows are dropped


class RefusalLog:
    """One INFO line for the first refusal of a caller with a code, then at most one
    summary per `every_s` ("N more in the last 60s"), on ``logger``: an agent with a
    revoked credential retries every heartbeat, and a line per request buried everything
    else (issue 15: one line per outage); a tenant looping on a refused lease did the same
    to the agent's log, at socket speed. An administrator's refusals (caller ``admin``) are
    each logged once per distinct message, since each is a different mistake worth
    reading."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = REFUSAL_SUMMARY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every_s = every_s
        self.clock = clock
        self._lock = threading.Lock()
        # key -> [window start, refusals since it began not logged, the last message]
        self._windows: dict[tuple[str, ...], list[Any]] = {}
        self._flushed_at = float("-inf")

    def refused(self, err: PoolError, caller: str) -> None:
        key = (caller, err.code) + ((err.message,) if caller == "admin" else ())
        now = self.clock()
        with self._lock:
            due = self._flush(now, key)
            window = self._windows.get(key)
            if window is None or (now - window[0] >= self.every_s and window[1] == 0):
                # The first, or the first after a quiet window: said as it is.
                if window is None and len(self._windows) >= _REFUSAL_KEYS_MAX:
                    self._windows.pop(next(iter(self._windows)))
                self._windows[key] = [now, 0, err.message]
                due.append(("refused: %s (%s): %s", err.code, caller, err.message))
            elif now - window[0] >= self.every_s:  # the window closed: this one ends it
                due.append(self._summary(key, window[1] + 1, now - window[0], err.message))
                self._windows[key] = [now, 0, err.message]
            else:
                window[1] += 1
                window[2] = err.message
        for line in due:
            self.logger.info(*line)

    @staticmethod
    def _summary(key: tuple[str, ...], count: int, span_s: float, latest: str) -> tuple[Any, ...]:
        return (
            "refused: %s (%s): %d more in the last %.0fs, the latest: %s",
            key[1],
            key[0],
            count,
            span_s,
            latest,
        )

    def _flush(self, now: float, skip: tuple[str, ...]) -> list[tuple[Any, ...]]:
        """The summaries of other callers' windows past `every_s` (under the lock), at most
        once a second; a window quiet since its line is forgotten."""
        if now - self._flushed_at < 1.0:
            return []
        self._flushed_at = now
        due: list[tuple[Any, ...]] = []
        for key, window in list(self._windows.items()):
            if key == skip or now - window[0] < self.every_s:
                continue
            if window[1]:
                due.append(self._summary(key, window[1], now - window[0], window[2]))
            del self._windows[key]
        return due
