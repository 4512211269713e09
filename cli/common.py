"""What every poolctl command shares: how it reaches poold, and how it prints and fails.

The context object (URL, admin token, one lazily opened client), the SIZE parameter
type, `--json`, rich tables of plain-text cells, and the one-line error
`poolctl: error[code]: message` with exit status 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cli.units import parse_size
from poold.api.client import PooldClient
from poold.errors import PoolError
from poold.settings import default_state_dir
from poold.wire.admin import DrainResult


class Size(click.ParamType):  # type: ignore[type-arg]
    """A byte count as people write it: 64GiB, 512M, 1048576."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = Size()


class Ctx:
    """The root group's context object: poold's URL and the admin token, read when needed."""

    def __init__(self, url: str, token: str | None, token_file: Path | None) -> None:
        self.url = url
        self._token = token
        self._token_file = token_file
        self._client: PooldClient | None = None

    def token(self) -> str:
        if self._token:
            return self._token
        path = self._token_file or default_state_dir() / "admin.token"
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise click.ClickException(
                f"no admin token: pass --token, set POOLD_TOKEN, or make {path} readable ({exc})"
            ) from exc

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def client(self) -> PooldClient:
        if self._client is None:
            self._client = PooldClient(self.url, self.token())
        return self._client


pass_ctx = click.make_pass_decorator(Ctx)
json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")


def fail(err: PoolError) -> NoReturn:
    """Print the error's code and message on one line and exit 1."""
    click.echo(f"poolctl: error[{err.code}]: {err.message}", err=True)
    raise SystemExit(1)


def run(fn: Callable[[], Any]) -> Any:
    """Call poold; a PoolError becomes `fail`."""
    try:
        return fn()
    except PoolError as err:
        fail(err)


def emit_json(data: Any) -> None:
    """Print models (or lists of them) as sorted, indented JSON."""

    def conv(obj: Any) -> Any:
        if isinstance(obj, BaseModel):
            return obj.model_dump(mode="json")
        if isinstance(obj, list):
            return [conv(o) for o in obj]
        return obj

    click.echo(json.dumps(conv(data), indent=2, sort_keys=True))


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A rich table; columns named for byte counts are right-aligned."""
    t = Table(title=title)
    for col in columns:
        t.add_column(
            col,
            justify="right"
            if col.endswith(("bytes", "free", "leased", "capacity", "quota"))
            else "left",
        )
    for row in rows:
        # Text, not str: device uids like "cxl:ram:..." must not turn into markup or emoji.
        t.add_row(*[Text(str(c) if c is not None else "-") for c in row])
    Console().print(t)


def emit_drained(out: DrainResult, as_json: bool) -> None:
    """What a drain or undrain (of a host or a device) left: state, deadline, leases."""
    if as_json:
        emit_json(out)
        return
    line = f"{out.target}: {out.state}"
    if out.deadline_at is not None:
        line += f"; live leases revoked at {out.deadline_at.isoformat(timespec='seconds')}"
    if out.live_leases:
        line += f"; {out.live_leases} live lease(s)"
    if out.revoked:
        line += f"; revoked now: {len(out.revoked)}"
    click.echo(line)
