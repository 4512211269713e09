"""Which hosts have news for their agent (a revocation, a lease the ledger ended, a
shrink request), so that poold tells them at once instead of at their next heartbeat?

A transaction that makes news for a host calls `tell(conn, host_ids)`; the news is
delivered when that transaction commits, never before (an agent woken early would
heartbeat and find nothing). On PostgreSQL `tell` sends `NOTIFY poold_news`, which
PostgreSQL delivers at commit to every poold's `NewsListener`, this one's included, so
an agent waiting on any poold hears of a revocation another poold made. On SQLite
(one poold) the ledger (`Ledger.write`, `Ledger.write_conn`) signals this process's
`HostNews` itself after the commit.

The news itself is only "look now": the agent answers a wake-up with a heartbeat,
whose reply already carries revocations, ended leases and shrink requests. A wake-up
therefore never needs to be exact, only never missed; so a listener that lost its
connection wakes every waiter when it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Iterator

from sqlalchemy import Connection, func, select

log = logging.getLogger("poold.news")

CHANNEL = "poold_news"

_local = threading.local()


@contextlib.contextmanager
def collecting() -> Iterator[set[int]]:
    """The hosts told of news inside the transaction this block runs (this thread)."""
    outer = getattr(_local, "pending", None)
    pending: set[int] = set()
    _local.pending = pending
    try:
        yield pending
    finally:
        _local.pending = outer


def tell(conn: Connection, host_ids: Iterable[int]) -> None:
    """Record news for ``host_ids`` in the current transaction (delivered at commit)."""
    ids = {int(h) for h in host_ids}
    if not ids:
        return
    if conn.dialect.name == "postgresql":
        # Every poold's listener hears it at commit, this one's too: one path for all.
        conn.execute(select(func.pg_notify(CHANNEL, ",".join(str(h) for h in sorted(ids)))))
        return
    pending: set[int] | None = getattr(_local, "pending", None)
    if pending is not None:
        pending.update(ids)


_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


class HostNews:
    """Per-host news counters and the agents waiting on them (this process).

    Signalled from worker threads and the listener thread; waited on from the event
    loop. A waiter gives the token it last saw; a different token (more news since,
    or another process's token after a failover) answers at once.
    """

    def __init__(self) -> None:
        # In every token: a token from another process (or an earlier run) never matches.
        self.instance = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._seq: dict[int, int] = {}
        self._waiters: dict[int, set[_Waiter]] = {}
        self._closed = False

    def token(self, host_id: int) -> str:
        with self._lock:
            return f"{self.instance}:{self._seq.get(host_id, 0)}"

    def signal(self, host_ids: Iterable[int]) -> None:
        with self._lock:
            woken: list[_Waiter] = []
            for host_id in host_ids:
                self._seq[host_id] = self._seq.get(host_id, 0) + 1
                woken.extend(self._waiters.pop(host_id, ()))
        for loop, fut in woken:
            loop.call_soon_threadsafe(_settle, fut)

    def close(self) -> None:
        """poold is stopping: every wait answers now, and later ones at once, so that
        no long poll holds up the server's graceful shutdown."""
        with self._lock:
            self._closed = True
        self.signal_all()

    def signal_all(self) -> None:
        """Wake every waiter (the listener may have missed notifications)."""
        with self._lock:
            hosts = list(self._waiters)
        self.signal(hosts)

    async def wait(self, host_id: int, since: str | None, timeout_s: float) -> tuple[bool, str]:
        """Wait up to ``timeout_s`` for news newer than ``since``: (news?, token now)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            now = f"{self.instance}:{self._seq.get(host_id, 0)}"
            if self._closed:
                return False, now
            if since != now:
                # More news since, another process's token (a failover), or a first
                # wait: the agent cannot know what it missed, so it looks.
                return True, now
            entry = (loop, fut)
            self._waiters.setdefault(host_id, set()).add(entry)
        try:
            await asyncio.wait_for(fut, timeout_s)
            woke = True
        except TimeoutError:
            woke = False
        finally:
            with self._lock:
                waiting = self._waiters.get(host_id)
                if waiting is not None:
                    waiting.discard(entry)
                    if not waiting:
                        del self._waiters[host_id]
        return woke, self.token(host_id)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class NewsListener:
    """LISTEN poold_news on a connection of its own (PostgreSQL), feeding `HostNews`.

    Reconnects with a back-off when the database goes; on every (re)connect it wakes
    all waiters, since notifications sent while it was away are lost.
    """

    def __init__(self, conninfo: str, news: HostNews) -> None:
        self.conninfo = conninfo
        self.news = news
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poold-news", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import psycopg

        backoff = 0.2
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    backoff = 0.2
                    self.news.signal_all()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self._deliver(note.payload)
            except psycopg.Error as exc:
                log.debug("news listener: %s; reconnecting", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _deliver(self, payload: str) -> None:
        try:
            hosts = [int(x) for x in payload.split(",") if x]
        except ValueError:
            log.debug("news listener: ignoring payload %r", payload)
            return
        self.news.signal(hosts)


def pg_conninfo(url: str) -> str | None:
    """A psycopg conninfo for a SQLAlchemy PostgreSQL URL; None for other databases."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if not parsed.drivername.startswith("postgresql"):
        return None
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)
