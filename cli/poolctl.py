"""poolctl: which commands the administrator's CLI has, and the options they all share.

This module only assembles the root group: `--url`, `--token`, `--token-file`,
`--format`, `--version`, the context object, and one subgroup (or command) per module
of this package. Views print tables (rich on a terminal, full-width plain text when
piped) or JSON; every error prints one line with its stable code and exits non-zero
(the scheme is in cli/common.py).
"""

from __future__ import annotations

from pathlib import Path

import click

from cli.accounting import accounting
from cli.audit import audit
from cli.common import (
    OUTPUT_FORMATS,
    POOLD_URL,
    Ctx,
    OutputFormat,
    PoolctlGroup,
    token_source,
)
from cli.db import db
from cli.devices import devices
from cli.hosts import hosts
from cli.leases import leases
from cli.status import status
from cli.tenants import tenants
from cli.top import top
from poold import __version__
from poold.settings import DEFAULT_PORT


@click.group("poolctl", cls=PoolctlGroup)
@click.version_option(__version__, "--version", prog_name="poolctl", message="%(prog)s %(version)s")
@click.option(
    "--url",
    envvar="POOLD_URL",
    show_envvar=True,
    type=POOLD_URL,
    default=f"http://127.0.0.1:{DEFAULT_PORT}",
    show_default=True,
    help="poold's API",
)
@click.option("--token", envvar="POOLD_TOKEN", show_envvar=True, default=None, help="admin token")
@click.option(
    "--token-file",
    envvar="POOLD_TOKEN_FILE",
    show_envvar=True,
    type=click.Path(path_type=Path),
    default=None,
    help="file holding the admin token (default: poold's state dir)",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(OUTPUT_FORMATS),
    default=None,
    help="table (rich), plain (full width, nothing cut) or json (as each view's --json); "
    "default: table on a terminal, plain when piped",
)
@click.pass_context
def main(
    ctx: click.Context,
    url: str,
    token: str | None,
    token_file: Path | None,
    output_format: OutputFormat | None,
) -> None:
    """Administer a poold far-memory pool."""
    ctx.obj = Ctx(url, token, token_file, output_format, token_source(ctx))
    ctx.call_on_close(ctx.obj.close)


for _command in (status, tenants, hosts, leases, devices, db, audit, accounting, top):
    main.add_command(_command)
