"""How poold runs: settings in, migrated ledger, API served by uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from poold.api.app import create_app
from poold.ledger import migrate
from poold.ledger.db import Ledger
from poold.settings import PooldSettings

log = logging.getLogger("poold")


def serve(settings: PooldSettings) -> None:
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = settings.resolved_database_url()
    if settings.upgrade_db:
        migrate.upgrade(url)
    ledger = Ledger(url)
    app = create_app(ledger, settings.resolved_admin_token())
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
    ledger.dispose()
