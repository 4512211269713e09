"""The `pool-agent` command: `pool-agent serve` and `pool-agent inventory`."""

from __future__ import annotations

import logging
from pathlib import Path

import click


@click.group()
def main() -> None:
    """pool-agent: hands this host's far memory to tenants over a Unix socket."""


@main.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, exists=True),
    envvar="POOL_AGENT_CONFIG",
    default=None,
    help="TOML config file",
)
@click.option("--host", envvar="POOL_AGENT_HOST", default=None, help="host name known to poold")
@click.option(
    "--poold-url",
    "poold_url",
    envvar="POOL_AGENT_POOLD_URL",
    multiple=True,
    help="a poold URL; repeat it or give a comma list for several (failover, in order)",
)
@click.option(
    "--poold-timeout",
    "poold_timeout_s",
    type=float,
    default=None,
    help="seconds one request to one poold may take",
)
@click.option(
    "--credential-file",
    type=click.Path(path_type=Path),
    default=None,
    envvar="POOL_AGENT_CREDENTIAL_FILE",
)
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path),
    default=None,
    envvar="POOL_AGENT_SOCKET",
)
@click.option("--socket-group", default=None, help="group owning the socket (mode 0660)")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None)
@click.option("--sysfs-root", type=click.Path(path_type=Path), default=None)
@click.option("--heartbeat-interval", "heartbeat_interval_s", type=float, default=None)
@click.option(
    "--emulated/--no-emulated",
    default=None,
    help="force the emulated device on or off (default: only without far memory)",
)
@click.option(
    "--emulated-capacity",
    "emulated_capacity_bytes",
    type=int,
    default=None,
    help="bytes of the emulated device (default: a quarter of RAM)",
)
@click.option("--log-level", default="info", envvar="POOL_AGENT_LOG_LEVEL", show_default=True)
def serve(
    config_path: Path | None, log_level: str, poold_url: tuple[str, ...], **overrides: object
) -> None:
    """Serve tenants on the agent socket and keep poold informed."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from agent import config as config_mod
    from agent.run import run

    # Each --poold-url may itself be a comma list (the config splits them); none given
    # leaves the config file's.
    urls = list(poold_url) or None
    raise SystemExit(run(config_mod.load(config_path, poold_url=urls, **overrides)))


try:  # the discovery package adds `pool-agent inventory`
    from agent.discovery.cli import inventory_command

    main.add_command(inventory_command, name="inventory")
except ImportError:  # pragma: no cover - only while discovery is being written
    pass
