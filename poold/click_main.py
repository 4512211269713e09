"""How does each of the project's programs say a failure of its own command line?

click prints usage errors as a multi-line ``Usage:``/``Error:`` block and exits 2, and
it catches EPIPE itself. poolctl, poolrun and both daemons print one line instead, each
in its own scheme and with its own exit status (poolrun must keep 2 free for CMD's). The
shared part is here: click runs outside its standalone mode, and whatever it raises goes
to the program's :meth:`OwnErrors.failed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import click


class OwnErrors(click.Command):
    """A click command (or, mixed in first, a group) whose failures its program prints.

    Subclasses implement :meth:`failed`: it exits for what it knows and re-raises the
    rest. :meth:`ran` runs after the command, inside the same handling (poolctl flushes
    stdout there, so that a reader gone shows as EPIPE here)."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            self.ran()
        except (Exception, click.Abort) as exc:  # click.Abort: Ctrl-C before the command
            self.failed(exc, prog_name or self.name or "?")
        raise SystemExit(rv if isinstance(rv, int) else 0)

    def ran(self) -> None:
        """After a command that returned (default: nothing)."""

    def failed(self, exc: BaseException, program: str) -> NoReturn:
        raise exc
