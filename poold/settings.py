"""Where poold keeps its state and how it is reached: flag > env > /etc/poold/poold.toml > default.

Every field reads ``POOLD_<FIELD>`` from the environment (poold.daemon_config layers
the sources and builds the flags from these fields); ``POOLD_LISTEN`` and ``POOLD_PORT``
keep working for the listen address. Byte counts take sizes as people write them
(``48MiB``; poold.sizes has the rule).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from poold.daemon_config import DaemonSettings, secret
from poold.logs import LogFormat, LogLevel
from poold.sizes import ByteCount

DEFAULT_PORT = 7340
DEFAULT_MAX_BODY_BYTES = 48 * 1024 * 1024  # poold.api.app says why
DEFAULT_CONFIG_FILE = Path("/etc/poold/poold.toml")


def default_state_dir() -> Path:
    """/var/lib/poold for root (as systemd's StateDirectory=), else the XDG state dir."""
    if os.geteuid() == 0:
        return Path("/var/lib/poold")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "poold"


class PooldSettings(DaemonSettings):
    model_config = SettingsConfigDict(env_prefix="POOLD_")

    state_dir: Path = Field(
        default_factory=default_state_dir,
        description="ledger (SQLite) and admin token; default /var/lib/poold as root, "
        "else $XDG_STATE_HOME/poold",
    )
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL of the ledger; default SQLite in the state dir"
    )
    listen_host: str = Field(
        default="127.0.0.1",
        validation_alias=AliasChoices("POOLD_LISTEN_HOST", "POOLD_LISTEN"),
        description="address the HTTP API listens on",
    )
    listen_port: int = Field(
        default=DEFAULT_PORT,
        ge=0,
        le=65535,
        validation_alias=AliasChoices("POOLD_LISTEN_PORT", "POOLD_PORT"),
        description="TCP port of the HTTP API",
    )
    admin_token: str | None = Field(
        default=None,
        json_schema_extra=secret(),
        description="the admin token; default read (or created) at state_dir/admin.token",
    )
    upgrade_db: bool = Field(default=True, description="apply pending alembic migrations at start")
    # Kept open, all of them: a connection opened for a burst and closed after it (what
    # SQLAlchemy's default pool, 5 kept + 10 overflow, does) costs a PostgreSQL
    # connection start, several round trips and authentication, per burst.
    db_pool_size: int = Field(
        default=15,
        ge=1,
        le=1000,
        description="ledger connections kept open; also how many requests do ledger work at once",
    )
    # Request bodies past this are refused unread (413 body_too_large); the default is a
    # little above the biggest legitimate one, a 100,000-lease heartbeat (poold/api/app.py).
    max_body_bytes: ByteCount = Field(
        default=DEFAULT_MAX_BODY_BYTES,
        gt=0,
        description="refuse request bodies past this size (413), unread",
    )
    host_down_after_s: float = Field(default=60.0, description="seconds before a host is down")
    # The reaper (poold/ledger/reaper.py): how often it runs and the clocks it enforces.
    reap_interval_s: float = Field(
        default=1.0, ge=0, description="seconds between reaper passes; 0 turns it off"
    )
    activation_deadline_s: float = Field(
        default=30.0, description="seconds a granted lease has to become active"
    )
    expiry_grace_s: float = Field(default=30.0, description="seconds past expiry before reaping")
    revoke_deadline_s: float = Field(
        default=30.0, description="seconds a revoked lease's holder has to let go"
    )
    host_silent_after_s: float = Field(
        default=10.0, description="seconds without a heartbeat before a host is silent"
    )
    host_silent_grace_s: float = Field(
        default=300.0, description="seconds a silent host's leases are held before reclaim"
    )
    # Pressure (poold/pressure.py): a device whose free bytes fall under this fraction of
    # its capacity makes poold ask tenants, replica bytes first, to give memory back.
    pressure_watermark: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="free fraction of a device under which tenants are asked to give back; "
        "0 turns it off",
    )
    shrink_deadline_s: float = Field(
        default=30.0, gt=0, description="seconds a tenant asked to give back has before revoke"
    )
    # What new DDR5 far memory costs per GiB-month: `poolctl accounting` prices what
    # recycled DDR4 saved against it. None: not configured, no savings shown.
    ddr5_cost_per_gib_month: float | None = Field(
        default=None, ge=0, description="price of new DDR5 per GiB-month, for accounting"
    )
    # Delegated capacity (poold/ledger/delegation.py): how long a host's reservations and
    # budgets live without a heartbeat renewing them, so how long its agent keeps granting
    # alone while poold is down.
    reservation_ttl_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds a host's reservations and budgets live unrenewed (poold down)",
    )
    log_level: LogLevel = Field(default="info", description="least level logged")
    log_format: LogFormat = Field(default="text", description="log lines as text or json")

    @field_validator("database_url")
    @classmethod
    def _a_usable_url(cls, value: str | None) -> str | None:
        """Parse the URL and load its driver now: failing inside engine or alembic setup,
        a string that is no URL, an unknown dialect or a driver not installed were a
        traceback at start. The URL is never repeated (it may hold a password)."""
        if value is None:
            return None
        try:
            parsed = make_url(value)
        except ArgumentError:
            raise ValueError(
                "not a SQLAlchemy URL: write dialect+driver://user:password@host/db, e.g. "
                "postgresql+psycopg://poold@db/poold or sqlite:////var/lib/poold/ledger.db"
            ) from None
        try:
            parsed.get_dialect().import_dbapi()
        except (NoSuchModuleError, ImportError) as exc:
            raise ValueError(f"no usable driver for {parsed.drivername!r}: {exc}") from None
        return value

    def shown_value(self, name: str, value: Any) -> Any:
        if name == "database_url" and isinstance(value, str):
            try:
                return make_url(value).render_as_string(hide_password=True)
            except ArgumentError:
                return value
        return super().shown_value(name, value)

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.state_dir / 'ledger.db'}"

    def admin_token_path(self) -> Path:
        return self.state_dir / "admin.token"

    def resolved_admin_token(self) -> str:
        """The admin token, creating it (mode 0600) on first start like a cluster secret."""
        if self.admin_token:
            return self.admin_token
        path = self.admin_token_path()
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = f"pt1.admin.{secrets.token_urlsafe(32)}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        return token
