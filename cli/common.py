"""What every poolctl command shares: how it reaches poold, how it prints, and how it fails.

The context object (URL, admin token, one lazily opened client, the output format),
the parameter types (SIZE, and names checked by the wire's own pydantic types),
`--json`, tables, and the one error line.

How output looks. `--format table` draws rich tables (cut to the terminal's width);
`--format plain` prints full-width, aligned plain text with nothing cut, for pipes,
`less` and `grep`; `--format json` is what every view's `--json` prints. Without
`--format`, stdout decides: table on a terminal, plain otherwise, so `poolctl leases
list | cat` shows whole lease ids.

How poolctl fails, one scheme for every command (tests match the code, never the
wording). Every failure is one line on stderr, `poolctl: error[CODE]: message`, and:

* exit 2, code `usage`: click refused the command line before anything ran: an
  unknown command or option, a missing argument, a value not of its option's type or
  range (a size, a number, a time, one of a fixed set such as `--state` or `--by`, a
  quota of 0 bytes), options that exclude each other, nothing to do;
* exit 1, poold's code: the command ran and poold (or the ledger) refused or failed:
  `unknown_tenant`, `unauthorized`, `poold_unreachable`...; and `bad_request` when
  poolctl refused a value by the wire's own rules (a tenant or host name, a media
  class, an annotation) before sending it: the code poold would have answered with,
  so a script sees one code whichever side refused;
* `poolctl audit` alone exits 2 for "needs a human" (any error included), and with
  `--json` also prints the error as a JSON object on stdout (cli/audit.py).

A missing admin token is `unauthorized` (exit 1); so is a token poold refused, said
as such. Ctrl-C is `interrupted`, exit 130 (`poolctl top` alone exits 0 on it).
A reader that stopped reading (`poolctl leases list | head -1`) ends poolctl quietly
with exit 0: the reader chose to stop, nothing failed, and a `set -o pipefail` script
taking the first line must not abort on it (ripgrep does the same; 141, a death by
SIGPIPE as coreutils', would fail that script for no fault of poolctl's).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args

import click
from click.core import ParameterSource
from pydantic import BaseModel, TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cli.units import parse_size
from poold.api.client import PooldClient
from poold.click_main import OwnErrors
from poold.errors import (
    BadRequest,
    CommandLineError,
    Forbidden,
    Interrupted,
    PoolError,
    Unauthorized,
)
from poold.settings import default_state_dir
from poold.wire.admin import DrainResult
from poold.wire.common import MAX_LEASE_BYTES, HostName, MediaClass, TenantName

OutputFormat = Literal["table", "plain", "json"]
OUTPUT_FORMATS: tuple[str, ...] = get_args(OutputFormat)

USAGE_EXIT = 2  # click's own exit status for a refused command line
MAX_LEASES_PER_CALL = 100_000  # the most `GET /v1/leases` returns (LeaseQuery.limit's bound)
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as shells report it
MAX_QUOTA_BYTES = MAX_LEASE_BYTES * 1024  # TenantSpec.quota_bytes's bound (1 EiB)


def fail(err: PoolError, exit_code: int = 1) -> NoReturn:
    """Print the error's code and message on one line (stderr) and exit."""
    message = " ".join(err.message.split())  # one line, whatever the message held
    click.echo(f"poolctl: error[{err.code}]: {message}", err=True)
    raise SystemExit(exit_code)


def usage_error(message: str) -> NoReturn:
    """Refuse the command line: `error[usage]`, exit 2 (click's usage status)."""
    fail(CommandLineError(message), USAGE_EXIT)


def describe_validation(exc: ValidationError) -> str:
    """Pydantic's errors as one line: `field: what is wrong`, never its multi-line dump."""
    parts = []
    for item in exc.errors():
        where = ".".join(str(p) for p in item["loc"])
        # A validator's ValueError reads "Value error, <its words>": keep its words.
        msg = str(item["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


# --- parameter types ----------------------------------------------------------------


class Size(click.ParamType):  # type: ignore[type-arg]
    """A byte count as people write it: 64GiB, 512M, 1048576; `positive` refuses 0."""

    name = "size"

    def __init__(
        self, *, positive: bool = False, zero_hint: str = "", max_bytes: int | None = None
    ) -> None:
        self.positive = positive
        self.zero_hint = zero_hint
        self.max_bytes = max_bytes

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            size = value
        else:
            try:
                size = parse_size(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        if self.positive and size <= 0:
            self.fail(f"{value!r} is 0 bytes{self.zero_hint}", param, ctx)
        if self.max_bytes is not None and size > self.max_bytes:
            # The wire's bound, said as a size rather than as pydantic's "less than or equal".
            self.fail(
                f"{value!r} is more than the most poold takes, {self.max_bytes} bytes", param, ctx
            )
        return size


SIZE = Size()
# A quota of 0 bytes lets a tenant lease nothing: never what an administrator means
# when creating or resizing one (to stop a tenant, delete it or drain its hosts).
QUOTA = Size(
    positive=True,
    max_bytes=MAX_QUOTA_BYTES,
    zero_hint="; a tenant with a 0-byte quota can lease nothing: give a positive size, "
    "or delete the tenant (`poolctl tenants delete`)",
)


class PooldURL(click.ParamType):  # type: ignore[type-arg]
    """poold's address: an http(s) URL with a host (and a port that can exist).

    Refused as usage before any request: an unparseable one was a traceback from httpx,
    and `notaurl` or `ftp://...` read as "poold unreachable".
    """

    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        import httpx  # as PooldClient does; not at import, to keep `poolctl --help` quick

        text = str(value)
        try:
            url = httpx.URL(text)
        except httpx.InvalidURL as exc:
            self.fail(f"{text!r} is not a URL ({exc}); e.g. http://127.0.0.1:7340", param, ctx)
        if url.scheme not in ("http", "https") or not url.host:
            self.fail(
                f"{text!r} is not an http(s) URL with a host, e.g. http://poold-a:7340", param, ctx
            )
        if url.port is not None and not 0 < url.port < 65536:
            self.fail(f"{text!r}: port {url.port} is not 1 to 65535", param, ctx)
        return text


POOLD_URL = PooldURL()


class WireValue(click.ParamType):  # type: ignore[type-arg]
    """A value checked by the wire's own pydantic type (TenantName, HostName, MediaClass).

    A refused value is `bad_request`, exit 1 (the code poold would answer with), said
    in one line that names the rule and the first character breaking it.
    """

    def __init__(self, annotated: Any, what: str, rule: str) -> None:
        self.name = what
        self.what = what
        self.rule = rule
        self._adapter: TypeAdapter[str] = TypeAdapter(annotated)
        meta = get_args(annotated)[1].metadata
        self._max = next((m.max_length for m in meta if hasattr(m, "max_length")), None)
        self._pattern: str | None = next(
            (m.pattern for m in meta if getattr(m, "pattern", None)), None
        )

    def why(self, value: str) -> str:
        """Which part of the rule `value` breaks."""
        if not value:
            return "it is empty"
        if self._max is not None and len(value) > self._max:
            return f"it is {len(value)} characters long, more than {self._max}"
        if self._pattern is not None:
            # The wire's name patterns are character classes: the shortest prefix that
            # fails ends at the first character the rule does not allow there.
            for i in range(len(value)):
                if not re.match(self._pattern, value[: i + 1]):
                    return f"{value[i]!r} at position {i + 1} is not allowed"
        return "it breaks the rule"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        try:
            return self._adapter.validate_python(text)
        except ValidationError:
            # Name the option (`--media`); an argument is named by the message itself.
            opts = param.opts if isinstance(param, click.Option) else []
            where = f"{max(opts, key=len)}: " if opts else ""
            raise BadRequest(
                f"{where}{text!r} is not a valid {self.what}: {self.why(text)}; "
                f"a {self.what} is {self.rule}",
                value=text,
            ) from None


TENANT_NAME = WireValue(
    TenantName,
    "tenant name",
    "1 to 128 letters, digits, '_', '.' or '-', starting with a letter or digit",
)
HOST_NAME = WireValue(
    HostName,
    "host name",
    "1 to 255 letters, digits, '_', '.' or '-', starting with a letter or digit",
)
# Media classes are open-ended on purpose: sysfs cannot tell DDR4 from DDR5 and
# administrators name their own ("ddr4", "ddr5", "hbm", "optane", "rack12-ddr4"), so
# poolctl checks the wire's rule (^[a-z0-9_-]+$, at most 32 characters), not a list.
MEDIA_CLASS = WireValue(
    MediaClass,
    "media class",
    "1 to 32 lower-case letters, digits, '_' or '-' (e.g. ddr4, ddr5, hbm)",
)


def exclusive(ctx: click.Context, *names: str) -> None:
    """Refuse (usage) when more than one of these parameters was given on the command
    line or in the environment; defaults do not count."""
    given = [
        n
        for n in names
        if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    if len(given) > 1:
        flags = [_flag(ctx, n) for n in given]
        usage_error(f"{' and '.join(flags)} exclude each other: give one")


def _flag(ctx: click.Context, name: str) -> str:
    for p in ctx.command.params:
        if p.name == name and p.opts:
            return max(p.opts, key=len)
    return name


# --- the context object -------------------------------------------------------------


class Ctx:
    """The root group's context object: poold's URL, the admin token (read when needed)
    and the output format asked for with --format (None: decided by stdout)."""

    def __init__(
        self,
        url: str,
        token: str | None,
        token_file: Path | None,
        output_format: OutputFormat | None = None,
        token_source: str = "--token",  # noqa: S107  # where the token came from, not one
    ) -> None:
        self.url = url
        self._token = token
        self._token_file = token_file
        self._token_source = token_source
        self.output_format = output_format
        self._client: PooldClient | None = None
        self.token_from: str | None = None  # where the token in use came from, once read

    def token(self) -> str:
        if self._token:
            token = self._checked(self._token, self._token_source)
            self.token_from = self._token_source  # set once checked: see explain()
            return token
        path = self._token_file or default_state_dir() / "admin.token"
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise Unauthorized(
                f"no admin token: pass --token, set POOLD_TOKEN, or make {path} readable "
                f"({exc.strerror or exc})",
                path=str(path),
            ) from exc
        token = self._checked(token, str(path))
        self.token_from = str(path)
        return token

    @staticmethod
    def _checked(token: str, source: str) -> str:
        """Refuse what no token is, before it reaches an HTTP header: an empty one (httpx
        refused `Bearer ` and said "poold unreachable") or one with spaces, control or
        non-ASCII characters (a wrong file, or a token pasted with its line break)."""
        if not token:
            raise Unauthorized(
                f"the admin token from {source} is empty: it is poold's admin.token "
                "(in poold's state dir)",
                source=source,
            )
        if not all("!" <= ch <= "~" for ch in token):
            raise Unauthorized(
                f"the admin token from {source} holds spaces, control or non-ASCII "
                "characters, which no token has: is it the right one?",
                source=source,
            )
        return token

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def client(self) -> PooldClient:
        if self._client is None:
            self._client = PooldClient(self.url, self.token())
        return self._client

    def explain(self, err: PoolError) -> PoolError:
        """poold's refusal of the token, said as what it is: the admin token was refused.

        poold's own words ("unknown agent credential") describe its lookup, not the
        administrator's mistake; the code stays the same.
        """
        if self.token_from is None:
            return err
        if isinstance(err, Unauthorized):
            return Unauthorized(
                f"poold at {self.url} refused the admin token from {self.token_from} "
                f"(poold: {err.message}); use the token in admin.token in poold's state dir",
                **err.detail,
            )
        if isinstance(err, Forbidden) and "admin token" in err.message:
            return Forbidden(
                f"the token from {self.token_from} is not the admin token (it is a host's "
                f"agent credential?); poold: {err.message}",
                **err.detail,
            )
        return err


pass_ctx = click.make_pass_decorator(Ctx)
json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")


def current_ctx() -> Ctx | None:
    ctx = click.get_current_context(silent=True)
    return ctx.find_object(Ctx) if ctx is not None else None


def run(fn: Callable[[], Any]) -> Any:
    """Call poold; a PoolError becomes `fail` (a refused token said as such)."""
    try:
        return fn()
    except PoolError as err:
        c = current_ctx()
        fail(c.explain(err) if c is not None else err)


# --- output -------------------------------------------------------------------------


def stdout_is_terminal() -> bool:
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def output_format(as_json: bool = False) -> OutputFormat:
    """json for --json; else the root's --format; else table on a terminal, plain if not."""
    if as_json:
        return "json"
    c = current_ctx()
    if c is not None and c.output_format is not None:
        return c.output_format
    return "table" if stdout_is_terminal() else "plain"


def wants_json(as_json: bool) -> bool:
    """Whether this view prints JSON: its own --json, or the root's --format json."""
    return output_format(as_json) == "json"


def emit_json(data: Any) -> None:
    """Print models (or lists or dicts of them) as sorted, indented JSON."""

    def conv(obj: Any) -> Any:
        if isinstance(obj, BaseModel):
            return obj.model_dump(mode="json")
        if isinstance(obj, list | tuple):
            return [conv(o) for o in obj]
        if isinstance(obj, dict):
            return {k: conv(v) for k, v in obj.items()}
        return obj

    click.echo(json.dumps(conv(data), indent=2, sort_keys=True))


# Right-aligned by default: columns named for byte counts, and counts of leases.
SIZE_COLUMNS = ("bytes", "free", "leased", "capacity", "quota", "leases")


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _is_right(col: str, right: Collection[str] | None) -> bool:
    return col in right if right is not None else col.endswith(SIZE_COLUMNS)


def make_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Collection[str] | None = None,
) -> Table:
    """A rich table of plain-text cells; `right` names the right-aligned columns
    (default: those named for byte counts)."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="right" if _is_right(col, right) else "left")
    for row in rows:
        # Text, not str: device uids like "cxl:ram:..." must not turn into markup or emoji.
        t.add_row(*[Text(_cell(c)) for c in row])
    return t


def plain_lines(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Collection[str] | None = None,
) -> list[str]:
    """The same table as aligned plain text: title, header, rows; no cell is ever cut."""
    cells = [[str(c) for c in columns], *[[_cell(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    aligned = [_is_right(col, right) for col in columns]
    lines = [title] if title else []
    for r in cells:
        lines.append(
            "  ".join(
                v.rjust(w) if a else v.ljust(w) for v, w, a in zip(r, widths, aligned, strict=True)
            ).rstrip()
        )
    return lines


def table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Collection[str] | None = None,
    console: Console | None = None,
) -> None:
    """Print a table in the current format: rich (table) or full-width plain text."""
    if output_format() == "table":
        (console or Console()).print(make_table(title, columns, rows, right=right))
        return
    for line in plain_lines(title, columns, rows, right=right):
        click.echo(line)
    click.echo("")


def key_values(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    """One record as `key: value` lines, keys right-aligned; values are never cut."""
    if title:
        click.echo(title)
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        click.echo(f"{key:>{width}}: {_cell(value)}")


def emit_drained(out: DrainResult, as_json: bool) -> None:
    """What a drain or undrain (of a host or a device) left: state, deadline, leases."""
    if wants_json(as_json):
        emit_json(out)
        return
    line = f"{out.target}: {out.state}"
    if out.deadline_at is not None:
        line += f"; live leases revoked at {out.deadline_at.isoformat(timespec='seconds')}"
    if out.live_leases:
        line += f"; {out.live_leases} live lease(s)"
    if out.revoked:
        line += f"; revoked now: {len(out.revoked)}"
    if not out.changed:
        line += "; nothing changed (it already was)"
    click.echo(line)


# --- the root group: every error in the one scheme ------------------------------------


class PoolctlGroup(OwnErrors, click.Group):
    """The root group: runs click without its own error printing, and prints every
    failure in the scheme of this module's docstring."""

    def ran(self) -> None:
        sys.stdout.flush()  # a reader gone shows here, not in the interpreter's exit

    def failed(self, exc: BaseException, program: str) -> NoReturn:
        if isinstance(exc, click.UsageError):  # BadParameter, MissingParameter...
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            usage_error(exc.format_message() + hint)
        if isinstance(exc, click.ClickException):  # FileError and the like
            fail(PoolError(exc.format_message()), exc.exit_code)
        if isinstance(exc, click.Abort):  # Ctrl-C (click turns KeyboardInterrupt into Abort)
            fail(Interrupted("interrupted"), INTERRUPTED_EXIT)
        if isinstance(exc, PoolError):  # raised outside `run`: a WireValue, a missing token...
            fail(exc)
        if isinstance(exc, ValidationError):  # a model built from the command line
            fail(BadRequest(describe_validation(exc)))
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            _quiet_stdout()  # the reader went away (`| head`): say nothing more
            raise SystemExit(0) from None  # not a failure (module docstring)
        raise exc

    # click catches EPIPE itself, even outside standalone mode, and exits 1: it is
    # turned into a plain exit 0 first, where click parses (--version, --help) and runs.
    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        with _reader_gone():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _reader_gone():
            return super().invoke(ctx)


@contextlib.contextmanager
def _reader_gone() -> Iterator[None]:
    """EPIPE on stdout (the reader stopped: `| head`) ends poolctl quietly, exit 0."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
        _quiet_stdout()
        raise click.exceptions.Exit(0) from None


def _quiet_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def token_source(ctx: click.Context) -> str:
    """How the user gave the token: on the command line or in POOLD_TOKEN."""
    src = ctx.get_parameter_source("token")
    return "POOLD_TOKEN" if src is ParameterSource.ENVIRONMENT else "--token"
