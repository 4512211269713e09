"""What the agent is told: its TOML config file, overridden by flags and environment."""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent.paths import default_socket_path
from poold.settings import DEFAULT_PORT


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/pool-agent")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "pool-agent"


def parse_poold_urls(values: str | Iterable[str]) -> list[str]:
    """Every poold URL in ``values``: each may be a comma (or whitespace) separated list.

    Order is kept (the first is asked first), repeats are dropped, and each must be an
    http(s) URL, so a typo fails at start rather than at the first failover.
    """
    items = [values] if isinstance(values, str) else list(values)
    urls: list[str] = []
    for item in items:
        for url in re.split(r"[,\s]+", item.strip()):
            url = url.rstrip("/")
            if not url:
                continue
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"not a poold URL (http://host:port): {url!r}")
            if url not in urls:
                urls.append(url)
    if not urls:
        raise ValueError("no poold URL given")
    return urls


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field(default_factory=socket.gethostname)
    # One or several poold processes sharing a ledger, asked in this order (failover):
    # a list, or a string of comma-separated URLs, in TOML, flags and environment alike.
    poold_url: list[str] = Field(default_factory=lambda: [f"http://127.0.0.1:{DEFAULT_PORT}"])
    # One request to one poold; a grant is retried within `grant_patience_s` in all.
    poold_timeout_s: float = Field(default=10.0, gt=0)
    grant_patience_s: float = Field(default=20.0, gt=0)
    credential: str | None = None
    credential_file: Path | None = None
    socket_path: Path = Field(default_factory=default_socket_path)
    socket_mode: int = 0o660
    socket_group: str | None = None
    state_dir: Path = Field(default_factory=default_state_dir)
    sysfs_root: Path = Path("/sys")
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    # The emulated device: used only when discovery finds no far memory, or forced.
    emulated: bool | None = None  # None: only when the host has no far memory
    emulated_capacity_bytes: int | None = Field(default=None, gt=0)  # None: 1/4 of RAM
    emulated_alignment_bytes: int = Field(default=2 << 20, gt=0)
    # How often the agent checks that each lease's holder process still lives.
    holder_check_interval_s: float = Field(default=1.0, gt=0)
    # 2 MiB pages for numa leases: off, prefer (fall back to 4 KiB) or required.
    hugepages: Literal["off", "prefer", "required"] = "off"
    # Fresh memfds kept ready for small leases (agent.warm); 0 turns it off.
    warm_pool_bytes: int = Field(default=64 << 20, ge=0)
    # Annotations by memdev serial or device uid (media, recycled, provenance, cost).
    annotations: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Hotplug: rescan after udev events on cxl/dax/memory/node settle for this long ...
    rescan_debounce_s: float = Field(default=0.5, ge=0)
    # ... and, without udev (containers) or when told not to use it, every this often.
    rescan_interval_s: float = Field(default=30.0, gt=0)
    udev: bool = True

    @field_validator("poold_url", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str) or (
            isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        ):
            return parse_poold_urls(value)
        return value

    def resolved_credential(self) -> str:
        if self.credential:
            return self.credential
        env = os.environ.get("POOL_AGENT_CREDENTIAL")
        if env:
            return env
        if self.credential_file is not None:
            return self.credential_file.read_text().strip()
        raise ValueError(
            "no agent credential: run `poolctl hosts add HOST` and pass --credential-file"
        )


def load(path: Path | None, **overrides: Any) -> AgentConfig:
    """The config file (if any) with non-None overrides applied on top."""
    data: dict[str, Any] = {}
    if path is not None:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return AgentConfig.model_validate(data)
