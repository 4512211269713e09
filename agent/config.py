"""What the agent is told: flag > env (POOL_AGENT_*) > /etc/pool-agent/agent.toml > default.

poold.daemon_config layers the sources (pydantic-settings) and builds the flags from
these fields; every field reads ``POOL_AGENT_<FIELD>``, and ``POOL_AGENT_SOCKET`` keeps
working for ``socket_path``. Byte counts take sizes (``64GiB``; poold.sizes).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from agent.paths import default_socket_path
from poold.daemon_config import DaemonSettings, load_settings, secret
from poold.logs import LogFormat, LogLevel
from poold.settings import DEFAULT_PORT
from poold.sizes import ByteCount

DEFAULT_CONFIG_FILE = Path("/etc/pool-agent/agent.toml")


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
            try:  # what httpx cannot parse ('http://[::1') was a traceback at start
                httpx.URL(url)
            except httpx.InvalidURL as exc:
                raise ValueError(f"not a poold URL (http://host:port): {url!r}: {exc}") from None
            if url not in urls:
                urls.append(url)
    if not urls:
        raise ValueError("no poold URL given")
    return urls


class AgentConfig(DaemonSettings):
    model_config = SettingsConfigDict(env_prefix="POOL_AGENT_")

    host: str = Field(default_factory=socket.gethostname, description="host name known to poold")
    # One or several poold processes sharing a ledger, asked in this order (failover):
    # a list, or a string of comma-separated URLs, in TOML, flags and environment alike
    # (NoDecode: the environment's string is split by the validator, not read as JSON).
    poold_url: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [f"http://127.0.0.1:{DEFAULT_PORT}"],
        description="poold URL(s), asked in order (failover); a comma list or repeated; "
        f"default http://127.0.0.1:{DEFAULT_PORT}",
    )
    # One request to one poold; a grant is retried within `grant_patience_s` in all.
    poold_timeout_s: float = Field(
        default=10.0, gt=0, description="seconds one request to one poold may take"
    )
    grant_patience_s: float = Field(
        default=20.0, gt=0, description="seconds a grant is retried in all"
    )
    credential: str | None = Field(
        default=None, json_schema_extra=secret(), description="the agent's poold credential"
    )
    credential_file: Path | None = Field(
        default=None, description="file holding the credential (`poolctl hosts add`)"
    )
    socket_path: Path = Field(
        default_factory=default_socket_path,
        validation_alias=AliasChoices("POOL_AGENT_SOCKET_PATH", "POOL_AGENT_SOCKET"),
        description="the tenant socket; default /run/poold/agent.sock as root",
    )
    socket_mode: int = Field(default=0o660, description="mode of the tenant socket (octal)")
    socket_group: str | None = Field(default=None, description="group owning the tenant socket")
    state_dir: Path = Field(
        default_factory=default_state_dir,
        description="the lease journal; default /var/lib/pool-agent as root",
    )
    sysfs_root: Path = Field(default=Path("/sys"), description="where sysfs is read and written")
    heartbeat_interval_s: float = Field(
        default=5.0, gt=0, description="seconds between heartbeats to poold"
    )
    # The emulated device: used only when discovery finds no far memory, or forced.
    emulated: bool | None = Field(
        default=None,
        description="force the emulated device on or off; default: only without far memory",
    )
    emulated_capacity_bytes: ByteCount | None = Field(
        default=None, gt=0, description="size of the emulated device; default a quarter of RAM"
    )
    emulated_alignment_bytes: ByteCount = Field(
        default=2 << 20, gt=0, description="alignment of emulated leases"
    )
    holder_check_interval_s: float = Field(
        default=1.0, gt=0, description="seconds between checks that lease holders live"
    )
    hugepages: Literal["off", "prefer", "required"] = Field(
        default="off", description="2 MiB pages for numa leases: off, prefer or required"
    )
    # The socket against hostile local users (agent/server.py SocketLimits).
    socket_max_connections: int = Field(default=1024, gt=0, description="connections at once")
    socket_max_connections_per_uid: int = Field(
        default=64, gt=0, description="connections at once from one uid"
    )
    socket_frame_timeout_s: float = Field(
        default=10.0, gt=0, description="seconds a started frame may take to arrive whole"
    )
    socket_idle_timeout_s: float = Field(
        default=300.0, gt=0, description="seconds an idle connection holding no lease is kept"
    )
    socket_reply_timeout_s: float = Field(
        default=30.0, gt=0, description="seconds a reply the peer does not read is kept"
    )
    socket_max_frame_bytes: ByteCount = Field(
        default=64 << 10, gt=0, description="largest request frame"
    )
    socket_max_queued_events: int = Field(
        default=256, gt=0, description="events queued for one tenant session that does not read"
    )
    # Lease work in flight (agent/admission.py InFlightLimits).
    in_flight_max_requests_per_uid: int = Field(
        default=16, gt=0, description="lease requests at once from one uid"
    )
    in_flight_max_bytes: ByteCount = Field(
        default=8 << 30, gt=0, description="bytes of lease memory being made at once"
    )
    in_flight_max_bytes_per_uid: ByteCount = Field(
        default=4 << 30, gt=0, description="bytes being made at once for one uid"
    )
    in_flight_wait_s: float = Field(
        default=5.0, ge=0, description="seconds a request past a limit waits before in_flight_limit"
    )
    numa_reserve_bytes: ByteCount = Field(
        default=64 << 20, ge=0, description="bytes of each far-memory node never offered"
    )
    devdax_holder_wait_s: float = Field(
        default=300.0,
        ge=0,
        description="seconds a released static dax device waits for its holders to let go",
    )
    warm_pool_bytes: ByteCount = Field(
        default=64 << 20, ge=0, description="fresh memfds kept ready for small leases; 0: off"
    )
    # Delegated capacity (agent/delegation.py): off by default until the races
    # tests/e2e/test_delegation_concurrency.py shows are closed (a heartbeat before a
    # local lease's commit, a drain or a quota cut while local grants are uncommitted).
    delegation: bool = Field(
        default=False, description="grant leases locally inside reservations poold delegates"
    )
    # RefillPolicy: the least the agent keeps reserved and budgeted ahead of demand, so a
    # burst (or poold down) finds room.
    delegation_min_reserve_bytes: ByteCount = Field(
        default=64 << 20, ge=0, description="least free reserved bytes kept per media class"
    )
    delegation_min_budget_leases: int = Field(
        default=16, ge=0, description="least free budgeted leases kept per tenant"
    )
    annotations: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per memdev serial or device uid: media, recycled, provenance, cost",
    )
    rescan_debounce_s: float = Field(
        default=0.5, ge=0, description="seconds udev events settle before a rescan"
    )
    rescan_interval_s: float = Field(
        default=30.0, gt=0, description="seconds between rescans without udev"
    )
    udev: bool = Field(default=True, description="watch udev for hotplug")
    # Prometheus metrics over HTTP (agent.metrics), host:port; empty: off.
    metrics_listen: str = Field(default="", description="host:port serving metrics; empty: off")
    log_level: LogLevel = Field(default="info", description="least level logged")
    log_format: LogFormat = Field(default="text", description="log lines as text or json")

    @field_validator("metrics_listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value:
            metrics_address(value)  # refuses what it cannot split
        return value

    @field_validator("poold_url", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str) or (
            isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        ):
            return parse_poold_urls(value)
        return value

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _octal_mode(cls, value: Any) -> Any:
        # A mode written as text (env, flag) is octal, as chmod reads it: "0660", "660".
        if isinstance(value, str):
            try:
                return int(value.removeprefix("0o"), 8)
            except ValueError:
                raise ValueError(f"not an octal mode: {value!r}") from None
        return value

    def resolved_credential(self) -> str:
        if self.credential:
            return self.credential
        if self.credential_file is not None:
            credential = self.credential_file.read_text().strip()
            if not credential:  # sent as `Bearer `, refused by httpx on every request
                raise ValueError(
                    f"the credential file {self.credential_file} is empty: it holds what "
                    "`poolctl hosts add HOST --credential-file` wrote"
                )
            return credential
        raise ValueError(
            "no agent credential: run `poolctl hosts add HOST` and pass --credential-file"
        )


def load(path: Path | None, **overrides: Any) -> AgentConfig:
    """The config from every source: non-None ``overrides`` (flags), env, file ``path``."""
    flags = {key: value for key, value in overrides.items() if value is not None}
    return load_settings(AgentConfig, path, flags)


def metrics_address(value: str) -> tuple[str, int]:
    """`host:port` (IPv6 in brackets; a bare `:port` is loopback) for the metrics server."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:9465)")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)
