"""How poold runs: settings in, migrated ledger, API served by uvicorn, systemd told."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import uvicorn
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from poold import collector, notify
from poold.api.app import create_app
from poold.errors import LedgerUnavailable
from poold.ledger import migrate
from poold.ledger.db import Ledger
from poold.ledger.delegation import DelegationPolicy
from poold.ledger.reaper import Reaper, ReaperPolicy, ReaperThread
from poold.settings import PooldSettings

log = logging.getLogger("poold")


class NotifyingServer(uvicorn.Server):
    """uvicorn's server that says READY=1 once its socket listens and pings the watchdog.

    The watchdog is fed from uvicorn's own event-loop tick (every 0.1 s), so a loop
    that stops turning stops the pings and systemd restarts poold.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.watchdog = notify.Watchdog()
        # Run before uvicorn waits for open requests (ends the agents' long polls).
        self.before_shutdown: list[Callable[[], None]] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            notify.notify(notify.READY, "STATUS=serving")
            self.watchdog.tick()

    async def on_tick(self, counter: int) -> bool:
        self.watchdog.tick()
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        notify.notify(notify.STOPPING)
        for hook in self.before_shutdown:
            hook()
        await super().shutdown(sockets)


def serve(settings: PooldSettings) -> None:
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = settings.resolved_database_url()
    if settings.upgrade_db:
        try:
            migrate.upgrade(url)
        except SQLAlchemyError as exc:
            # The ledger cannot be opened at all (PostgreSQL down, a SQLite file in a
            # directory that does not exist): one coded line, not alembic's traceback.
            why = " ".join(str(getattr(exc, "orig", None) or exc).split())
            redacted = make_url(url).render_as_string(hide_password=True)
            raise LedgerUnavailable(f"cannot open the ledger at {redacted}: {why}") from None
    ledger = Ledger(url, pool_size=settings.db_pool_size, max_overflow=0)
    app = create_app(
        ledger, settings.resolved_admin_token(), max_body_bytes=settings.max_body_bytes
    )
    policy = ReaperPolicy.from_settings(settings)
    app.state.reaper_policy = policy
    app.state.ddr5_cost_per_gib_month = settings.ddr5_cost_per_gib_month
    app.state.pressure_watermark = settings.pressure_watermark
    app.state.shrink_deadline_s = settings.shrink_deadline_s
    app.state.delegation_policy = DelegationPolicy(ttl_s=settings.reservation_ttl_s)
    reaper = Reaper(ledger, policy)
    # One pass before serving: leases of hosts this poold has not heard yet are
    # held before their agents' first (replayed) heartbeat can arrive, so a
    # lease never expires because poold itself was down (reaper.py, outage rule).
    started = time.perf_counter()
    first = reaper.run_once()
    app.state.metrics.reaper_pass("ok", time.perf_counter() - started)
    log.info(
        "reaper: first pass held %d lease(s), %d transition(s); every %gs",
        first.held,
        first.transitions(),
        settings.reap_interval_s,
    )
    reaper_thread = ReaperThread(
        reaper, settings.reap_interval_s, on_pass=app.state.metrics.reaper_pass
    )
    if settings.reap_interval_s > 0:  # 0 turns the periodic reaper off (another poold runs it)
        reaper_thread.start()
    log.info(
        "poold listening on http://%s:%d, ledger %s",
        settings.listen_host,
        settings.listen_port,
        ledger.engine.url.render_as_string(hide_password=True),
    )
    config = uvicorn.Config(
        app,
        host=settings.listen_host,
        port=settings.listen_port,
        log_config=None,  # poold.logs set up logging; uvicorn's records go through it
        http="httptools",
        access_log=False,
        lifespan="off",
    )
    collector.tune()
    server = NotifyingServer(config)
    server.before_shutdown.append(ledger.news.close)
    try:
        server.run()
    finally:
        reaper_thread.stop()
        ledger.dispose()
    if not server.started:
        raise SystemExit(1)  # uvicorn logged why (the port taken, say)
