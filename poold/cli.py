"""The `poold` command: `poold serve` (the default), `config show`, `install-units`, `demo`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

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
from poold.errors import ConfigInvalid, LedgerUnavailable
from poold.settings import DEFAULT_CONFIG_FILE, PooldSettings
from poold.units import DEFAULT_DEST

PROG = "poold"


def settings_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options `serve` and `config show` share: one per setting worth a flag, plus --config."""
    options = [
        click.option(
            "--config",
            "config_path",
            type=click.Path(path_type=Path, dir_okay=False),
            envvar="POOLD_CONFIG",
            default=None,
            help=f"TOML config file (keys are the setting names) [env POOLD_CONFIG; "
            f"default {DEFAULT_CONFIG_FILE} when it exists]",
        ),
        setting_option(PooldSettings, "state_dir", "--state-dir", type=click.Path(path_type=Path)),
        setting_option(PooldSettings, "database_url", "--database-url"),
        setting_option(PooldSettings, "listen_host", "--listen"),
        setting_option(PooldSettings, "listen_port", "--port", type=int),
        setting_option(PooldSettings, "upgrade_db", "--upgrade-db/--no-upgrade-db"),
        setting_option(PooldSettings, "max_body_bytes", "--max-body-bytes", metavar="SIZE"),
        setting_option(PooldSettings, "reap_interval_s", "--reap-interval", type=float),
        setting_option(PooldSettings, "log_level", "--log-level"),
        setting_option(
            PooldSettings, "log_format", "--log-format", type=click.Choice(["text", "json"])
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def settings_from(
    ctx: click.Context, config_path: Path | None
) -> tuple[PooldSettings, Path | None]:
    """The effective settings of this command line, or exit 2 naming what was refused."""
    path = config_file(config_path, DEFAULT_CONFIG_FILE)
    try:
        return load_settings(PooldSettings, path, given_flags(ctx, PooldSettings)), path
    except ConfigInvalid as err:
        refuse(PROG, err)


@click.group(cls=DaemonGroup, name=PROG, invoke_without_command=True)
@click.version_option(__version__, "--version", prog_name=PROG, message="%(prog)s %(version)s")
@click.pass_context
def main(ctx: click.Context) -> None:
    """poold: the central far-memory pool daemon."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(serve)


@main.command()
@settings_options
@click.pass_context
def serve(ctx: click.Context, /, config_path: Path | None, **_flags: object) -> None:
    """Serve the poold HTTP API."""
    settings, _ = settings_from(ctx, config_path)
    from poold.logs import dump_stacks_on_sigusr1, setup_logging
    from poold.server import serve as run

    setup_logging(settings.log_level, settings.log_format)
    dump_stacks_on_sigusr1()
    try:
        run(settings)
    except LedgerUnavailable as err:  # at start: nothing is served yet
        click.echo(f"{PROG}: error[{err.code}]: {err.message}", err=True)
        raise SystemExit(1) from None


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
    """Every setting `poold serve` would run with, and where each comes from (secrets hidden)."""
    settings, path = settings_from(ctx, config_path)
    print_settings(settings, path, given_flags(ctx, PooldSettings), as_json)


@main.command("install-units")
@click.option(
    "--prefix",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="installation prefix: programs in PREFIX/bin, README in PREFIX/share/doc/poold",
)
@click.option(
    "--bindir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="where poold, pool-agent and poolctl are [default: this Python's scripts dir]",
)
@click.option(
    "--docdir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="where the README goes (Documentation=) [default: PREFIX/share/doc/poold]",
)
@click.option(
    "--dest",
    type=click.Path(path_type=Path, file_okay=False),
    default=DEFAULT_DEST,
    show_default=True,
    help="where the units are written",
)
def install_units(
    prefix: Path | None, bindir: Path | None, docdir: Path | None, dest: Path
) -> None:
    """Write the systemd units with this installation's real paths (then daemon-reload)."""
    from poold import units

    if prefix is not None and bindir is not None:
        raise click.UsageError("give --prefix or --bindir, not both")
    layout = units.Layout.resolve(prefix=prefix, bindir=bindir, docdir=docdir)
    try:
        written = units.install(dest, layout)
    except (OSError, ValueError) as err:
        click.echo(f"{PROG}: error[install_failed]: {err}", err=True)
        raise SystemExit(1) from None
    for path in written:
        click.echo(str(path))
    click.echo(
        f"# ExecStart= runs {layout.command('poold', 'poold')}; now: systemctl daemon-reload",
        err=True,
    )


@main.command()
@click.option("--size-mib", default=64, show_default=True, help="how much the tenant leases")
@click.option("--keep", is_flag=True, help="keep the temporary state directory")
def demo(size_mib: int, keep: bool) -> None:
    """Run poold, an agent and a sample tenant end to end on SQLite, then stop."""
    from poold.demo import run_demo

    raise SystemExit(run_demo(size_mib=size_mib, keep=keep))
