"""The `pool-agent` command: `pool-agent serve`, `config show` and `inventory`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from agent.config import DEFAULT_CONFIG_FILE, AgentConfig
from poold import __version__
from poold.daemon_config import (
    DaemonGroup,
    config_file,
    given_flags,
    load_settings,
    print_settings,
    refuse,
    setting_option,
)
from poold.errors import ConfigInvalid

PROG = "pool-agent"


def settings_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options `serve` and `config show` share: one per setting worth a flag, plus --config."""
    path = click.Path(path_type=Path)
    options = [
        click.option(
            "--config",
            "config_path",
            type=click.Path(path_type=Path, dir_okay=False),
            envvar="POOL_AGENT_CONFIG",
            default=None,
            help=f"TOML config file (keys are the setting names) [env POOL_AGENT_CONFIG; "
            f"default {DEFAULT_CONFIG_FILE} when it exists]",
        ),
        setting_option(AgentConfig, "host", "--host"),
        setting_option(AgentConfig, "poold_url", "--poold-url", multiple=True),
        setting_option(AgentConfig, "poold_timeout_s", "--poold-timeout", type=float),
        setting_option(AgentConfig, "credential_file", "--credential-file", type=path),
        setting_option(AgentConfig, "socket_path", "--socket", type=path),
        setting_option(AgentConfig, "socket_group", "--socket-group"),
        setting_option(AgentConfig, "state_dir", "--state-dir", type=path),
        setting_option(AgentConfig, "sysfs_root", "--sysfs-root", type=path),
        setting_option(AgentConfig, "heartbeat_interval_s", "--heartbeat-interval", type=float),
        setting_option(AgentConfig, "emulated", "--emulated/--no-emulated"),
        setting_option(
            AgentConfig, "emulated_capacity_bytes", "--emulated-capacity", metavar="SIZE"
        ),
        setting_option(AgentConfig, "metrics_listen", "--metrics-listen", metavar="HOST:PORT"),
        setting_option(AgentConfig, "log_level", "--log-level"),
        setting_option(
            AgentConfig, "log_format", "--log-format", type=click.Choice(["text", "json"])
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def config_from(ctx: click.Context, config_path: Path | None) -> tuple[AgentConfig, Path | None]:
    """The effective config of this command line, or exit 2 naming what was refused."""
    path = config_file(config_path, DEFAULT_CONFIG_FILE)
    try:
        return load_settings(AgentConfig, path, given_flags(ctx, AgentConfig)), path
    except ConfigInvalid as err:
        refuse(PROG, err)


@click.group(cls=DaemonGroup, name=PROG)
@click.version_option(__version__, "--version", prog_name=PROG, message="%(prog)s %(version)s")
def main() -> None:
    """pool-agent: hands this host's far memory to tenants over a Unix socket."""


@main.command()
@settings_options
@click.pass_context
def serve(ctx: click.Context, /, config_path: Path | None, **_flags: object) -> None:
    """Serve tenants on the agent socket and keep poold informed."""
    config, _ = config_from(ctx, config_path)
    from agent.run import run
    from poold.logs import dump_stacks_on_sigusr1, setup_logging

    setup_logging(config.log_level, config.log_format)
    dump_stacks_on_sigusr1()
    raise SystemExit(run(config))


@main.group()
def config() -> None:
    """The effective configuration."""


@config.command("show")
@settings_options
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@click.pass_context
def config_show(
    ctx: click.Context, /, config_path: Path | None, as_json: bool, **_flags: object
) -> None:
    """Every setting `pool-agent serve` would run with, and where each comes from."""
    settings, path = config_from(ctx, config_path)
    print_settings(settings, path, given_flags(ctx, AgentConfig), as_json)


try:  # the discovery package adds `pool-agent inventory`
    from agent.discovery.cli import inventory_command

    main.add_command(inventory_command, name="inventory")
except ImportError:  # pragma: no cover - only while discovery is being written
    pass
