"""How poold runs: settings in, migrated ledger, API served by uvicorn."""

from __future__ import annotations

import logging
import time

import uvicorn

from poold.api.app import create_app
from poold.ledger import migrate
from poold.ledger.db import Ledger
from poold.ledger.reaper import Reaper, ReaperPolicy, ReaperThread
from poold.settings import PooldSettings

log = logging.getLogger("poold")


def serve(settings: PooldSettings) -> None:
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = settings.resolved_database_url()
    if settings.upgrade_db:
        migrate.upgrade(url)
    ledger = Ledger(url)
    app = create_app(
        ledger, settings.resolved_admin_token(), max_body_bytes=settings.max_body_bytes
    )
    policy = ReaperPolicy.from_settings(settings)
    app.state.reaper_policy = policy
    app.state.ddr5_cost_per_gib_month = settings.ddr5_cost_per_gib_month
    app.state.pressure_watermark = settings.pressure_watermark
    app.state.shrink_deadline_s = settings.shrink_deadline_s
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
    uvicorn.run(
        app,
        host=settings.listen_host,
        port=settings.listen_port,
        log_level="warning",
        http="httptools",
        access_log=False,
        lifespan="off",
    )
    reaper_thread.stop()
    ledger.dispose()
