"""Where poold keeps its state and how it is reached: settings from flags and environment."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from pydantic import BaseModel, Field

DEFAULT_PORT = 7340
DEFAULT_MAX_BODY_BYTES = 48 * 1024 * 1024  # poold.api.app says why


def default_state_dir() -> Path:
    """/var/lib/poold for root (as systemd's StateDirectory=), else the XDG state dir."""
    if os.geteuid() == 0:
        return Path("/var/lib/poold")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "poold"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(f"POOLD_{name.upper()}")
    return float(raw) if raw else default


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(f"POOLD_{name.upper()}")
    return int(raw) if raw else default


def _env_optional_float(name: str) -> float | None:
    raw = os.environ.get(f"POOLD_{name.upper()}")
    return float(raw) if raw else None


class PooldSettings(BaseModel):
    state_dir: Path = Field(default_factory=default_state_dir)
    database_url: str | None = None  # None: SQLite in state_dir
    listen_host: str = "127.0.0.1"
    listen_port: int = DEFAULT_PORT
    admin_token: str | None = None  # None: read or create state_dir/admin.token
    upgrade_db: bool = True
    # Request bodies past this are refused unread (413 body_too_large); the default is a
    # little above the biggest legitimate one, a 100,000-lease heartbeat (poold/api/app.py).
    max_body_bytes: int = Field(
        default_factory=lambda: _env_int("max_body_bytes", DEFAULT_MAX_BODY_BYTES), gt=0
    )
    host_down_after_s: float = 60.0
    # The reaper (poold/ledger/reaper.py): how often it runs and the clocks it enforces.
    # Each reads POOLD_<NAME> from the environment when not given, so that a unit file
    # or a test can tune it without a flag for every knob.
    reap_interval_s: float = Field(default_factory=lambda: _env_float("reap_interval_s", 1.0))
    activation_deadline_s: float = Field(
        default_factory=lambda: _env_float("activation_deadline_s", 30.0)
    )
    expiry_grace_s: float = Field(default_factory=lambda: _env_float("expiry_grace_s", 30.0))
    revoke_deadline_s: float = Field(default_factory=lambda: _env_float("revoke_deadline_s", 30.0))
    host_silent_after_s: float = Field(
        default_factory=lambda: _env_float("host_silent_after_s", 10.0)
    )
    host_silent_grace_s: float = Field(
        default_factory=lambda: _env_float("host_silent_grace_s", 300.0)
    )
    # Pressure (poold/pressure.py): a device whose free bytes fall under this fraction of
    # its capacity makes poold ask tenants, replica bytes first, to give memory back.
    # 0 turns it off.
    pressure_watermark: float = Field(
        default_factory=lambda: _env_float("pressure_watermark", 0.05), ge=0, lt=1
    )
    # How long a tenant asked to give memory back has before poold revokes the lease.
    shrink_deadline_s: float = Field(
        default_factory=lambda: _env_float("shrink_deadline_s", 30.0), gt=0
    )
    # What new DDR5 far memory costs per GiB-month: `poolctl accounting` prices what
    # recycled DDR4 saved against it. None: not configured, no savings shown.
    ddr5_cost_per_gib_month: float | None = Field(
        default_factory=lambda: _env_optional_float("ddr5_cost_per_gib_month"), ge=0
    )

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
