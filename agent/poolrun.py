"""How does a program that only takes a device path (LMCache ``dax.device_path``, Mooncake
``MC_CXL_DEV_PATH``) use a pool lease without any pool code?

``poolrun --size 64GiB -- CMD...`` leases through the agent's socket, starts CMD with the
lease's fd inherited and the lease described in its environment, renews while CMD runs,
forwards signals to it, signals it when poold revokes the lease (before the deadline), and
releases the lease when CMD exits, exiting with CMD's status::

    POOLD_LEASE_PATH   /proc/self/fd/N (or /dev/daxX.Y for a devdax lease CMD may open)
    POOLD_LEASE_FD     N, the inherited fd
    POOLD_LEASE_BYTES  the length CMD may map (MAP_SHARED)
    POOLD_LEASE_NODE   the NUMA node of the memory, when the agent knows it
    POOLD_LEASE_POPULATED  1 when every page was faulted in before CMD started (--populate)
    POOLD_LEASE_ID, POOLD_LEASE_MEDIA, POOLD_LEASE_BACKEND, POOLD_LEASE_PAGE_BYTES

Exit status: CMD's; 128 + N when CMD died of signal N (as a shell reports it); 125 when
poolrun itself failed, a refused command line included (as env(1) and timeout(1) do, so no
status of poolrun's own is mistaken for CMD's), with one line ``poolrun: error[CODE]:
message`` (``usage`` for the command line, else the agent's code); 126/127 when CMD could
not be run. If poolrun is killed outright, CMD gets SIGTERM (PR_SET_PDEATHSIG): the lease's holder
is gone, and the agent orphans it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import FrameType
from typing import Any, Final, NoReturn

import click
from pydantic import TypeAdapter, ValidationError

from agent.client import Lease, PoolClient
from poold import __version__
from poold.click_main import OwnErrors
from poold.errors import CommandLineError, Interrupted, PoolError
from poold.logs import setup_logging
from poold.sizes import parse_size
from poold.wire.common import MAX_LEASE_BYTES, MediaClass, TenantName

log = logging.getLogger("poolrun")

EXIT_POOLRUN_FAILED: Final = 125  # as env(1), timeout(1) and container runners use it
EXIT_NOT_EXECUTABLE: Final = 126
EXIT_NOT_FOUND: Final = 127
EXIT_INTERRUPTED: Final = 130  # 128 + SIGINT: Ctrl-C before CMD started
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
# Forwarded to CMD as they arrive; anything else keeps its default action on poolrun.
FORWARDED_SIGNALS: Final = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)
_PR_SET_PDEATHSIG: Final = 1  # include/uapi/linux/prctl.h


def parse_signal(value: str) -> signal.Signals:
    """A signal by name (``TERM``, ``SIGTERM``) or number."""
    text = value.strip().upper()
    try:
        return signal.Signals(int(text)) if text.isdigit() else signal.Signals[_sig_name(text)]
    except (KeyError, ValueError):
        raise ValueError(f"unknown signal {value!r}") from None


def _sig_name(text: str) -> str:
    return text if text.startswith("SIG") else f"SIG{text}"


def lease_path(lease: Lease) -> str:
    """What CMD opens: the dax device itself when it is one CMD may open, else the fd's
    /proc path (the same memory; a memfd has no other name)."""
    fd = lease.fd
    if lease.backend == "devdax":
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith("/dev/dax") and os.access(target, os.R_OK | os.W_OK):
            return target
    return f"/proc/self/fd/{fd}"


def lease_environment(lease: Lease) -> dict[str, str]:
    """The ``POOLD_LEASE_*`` variables CMD finds the lease by."""
    env = {
        "POOLD_LEASE_PATH": lease_path(lease),
        "POOLD_LEASE_FD": str(lease.fd),
        "POOLD_LEASE_BYTES": str(lease.length_bytes),
        "POOLD_LEASE_ID": lease.lease_id,
        "POOLD_LEASE_MEDIA": lease.media,
        "POOLD_LEASE_BACKEND": lease.backend,
        "POOLD_LEASE_PAGE_BYTES": str(lease.page_size_bytes),
    }
    if lease.numa_node is not None:
        env["POOLD_LEASE_NODE"] = str(lease.numa_node)
    env["POOLD_LEASE_POPULATED"] = "1" if lease.populated else "0"
    return env


def fail(err: PoolError, exit_code: int = EXIT_POOLRUN_FAILED, *, doing: str = "") -> int:
    """Say why poolrun itself failed, on one line with the error's code; its exit status."""
    message = doing + " ".join(err.message.split())
    click.echo(f"poolrun: error[{err.code}]: {message}", err=True)
    return exit_code


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _parent_death_signal(sig: int) -> Callable[[], None]:
    """A preexec_fn that has the kernel send ``sig`` to CMD when poolrun dies (even by
    SIGKILL): CMD must not go on using memory whose lease nobody holds. Only a prctl
    call runs in the forked child (libc is loaded here, before the fork)."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # poolrun died before the prctl took hold
            os._exit(EXIT_POOLRUN_FAILED)

    return preexec


@dataclass
class LeaseRequest:
    """What poolrun asks the agent for."""

    size_bytes: int
    ttl_s: int = 60
    media: str | None = None
    tenant: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    wait_s: float = 0
    numa_node: int | None = None
    hugepages: str | None = None
    populate: bool = False


class _Runner:
    """CMD under one lease: spawned, signalled, waited for."""

    def __init__(self, revoke_signal: signal.Signals | None) -> None:
        self.revoke_signal = revoke_signal
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._pending: list[int] = []  # signals that came before CMD existed
        self._revoke_sent = False

    def forward(self, signum: int, _frame: FrameType | None = None) -> None:
        with self._lock:
            child = self._child
            if child is None:
                self._pending.append(signum)
                return
        self._signal(child, signum)

    def on_revoke(self, lease: Lease, deadline_at: datetime) -> None:
        left_s = (deadline_at - datetime.now(UTC)).total_seconds()
        log.warning(
            "lease %s revoked: its memory goes at %s (in %.1f s)",
            lease.lease_id,
            deadline_at.isoformat(),
            left_s,
        )
        self._tell_revoked()

    def on_lost(self, lease: Lease) -> None:
        log.warning("lease %s is no longer active (expired or reclaimed)", lease.lease_id)
        self._tell_revoked()

    def _tell_revoked(self) -> None:
        with self._lock:
            child, already = self._child, self._revoke_sent
            self._revoke_sent = True
        if child is None or already or self.revoke_signal is None:
            return
        log.warning("sending %s to pid %d", self.revoke_signal.name, child.pid)
        self._signal(child, self.revoke_signal)

    @staticmethod
    def _signal(child: subprocess.Popen[bytes], signum: int) -> None:
        child.send_signal(signum)  # does nothing once CMD is waited for

    def run(self, command: Sequence[str], env: Mapping[str, str], fd: int) -> int:
        previous = {sig: signal.signal(sig, self.forward) for sig in FORWARDED_SIGNALS}
        try:
            try:
                child = subprocess.Popen(
                    list(command),
                    env=dict(env),
                    pass_fds=(fd,),
                    preexec_fn=_parent_death_signal(signal.SIGTERM),
                )
            except FileNotFoundError:
                click.echo(f"poolrun: {command[0]}: command not found", err=True)
                return EXIT_NOT_FOUND
            except PermissionError:
                click.echo(f"poolrun: {command[0]}: permission denied", err=True)
                return EXIT_NOT_EXECUTABLE
            with self._lock:
                self._child = child
                pending, self._pending = self._pending, []
                revoked = self._revoke_sent
            for signum in pending:
                self._signal(child, signum)
            if revoked and self.revoke_signal is not None:
                self._signal(child, self.revoke_signal)
            return exit_status(child.wait())
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run(
    command: Sequence[str],
    request: LeaseRequest,
    *,
    socket_path: str | None = None,
    revoke_signal: signal.Signals | None = signal.SIGTERM,
) -> int:
    """Lease, run CMD under the lease, release; CMD's exit status (see the module doc)."""
    runner = _Runner(revoke_signal)
    with PoolClient(socket_path) as client:
        try:
            lease = client.lease(
                request.size_bytes,
                ttl_s=request.ttl_s,
                media=request.media,
                tenant=request.tenant,
                labels=request.labels,
                wait_s=request.wait_s,
                on_revoke=runner.on_revoke,
                on_lost=runner.on_lost,
                populate=request.populate,
                hugepages=request.hugepages,
                numa_node=request.numa_node,
            )
        except PoolError as err:
            return fail(err, doing="cannot lease: ")
        with lease:
            env = {**os.environ, **lease_environment(lease)}
            log.info(
                "lease %s: %d bytes %s/%s at %s",
                lease.lease_id,
                lease.length_bytes,
                lease.backend,
                lease.media,
                env["POOLD_LEASE_PATH"],
            )
            status = runner.run(command, env, lease.fd)
    return status


def _size(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    try:
        size = parse_size(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    # The wire's bounds, said here rather than as the agent's pydantic refusal.
    if not 0 < size <= MAX_LEASE_BYTES:
        raise click.BadParameter(f"{value!r} is {size} bytes: a lease is 1 byte to 1 PiB")
    return size


def _wire_name(annotated: Any, what: str, rule: str) -> Callable[..., str | None]:
    """A callback checking an option by the wire's own type, refused as usage in one line."""
    adapter: TypeAdapter[str] = TypeAdapter(annotated)

    def check(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return adapter.validate_python(value)
        except ValidationError:
            raise click.BadParameter(f"{value!r} is not a valid {what}: {rule}") from None

    return check


def _signal_option(
    _ctx: click.Context, _param: click.Parameter, value: str
) -> signal.Signals | None:
    if value.lower() == "none":
        return None
    try:
        return parse_signal(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def _labels(_ctx: click.Context, _param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in value:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE")
        labels[key] = val
    return labels


class _PoolrunCommand(OwnErrors):
    """poolrun's command line: a refused one is one line, `error[usage]`, exit 125."""

    def failed(self, exc: BaseException, program: str) -> NoReturn:
        if isinstance(exc, click.UsageError):  # BadParameter, MissingParameter...
            hint = " (see 'poolrun --help')"
            sys.exit(fail(CommandLineError(exc.format_message() + hint)))
        if isinstance(exc, click.ClickException):
            sys.exit(fail(PoolError(exc.format_message())))
        if isinstance(exc, click.Abort):  # Ctrl-C before CMD ran
            sys.exit(fail(Interrupted("interrupted"), EXIT_INTERRUPTED))
        raise exc


@click.command(
    cls=_PoolrunCommand,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
)
@click.option("--size", required=True, callback=_size, help="lease size: 64GiB, 512M, bytes")
@click.option(
    "--media",
    default=None,
    callback=_wire_name(
        MediaClass, "media class", "1 to 32 lower-case letters, digits, '_' or '-'"
    ),
    help="media class (ddr5, ddr4, emulated...)",
)
@click.option("--node", "numa_node", type=click.IntRange(min=0), default=None, help="NUMA node")
@click.option(
    "--hugepages",
    type=click.Choice(["off", "prefer", "required"]),
    default=None,
    help="2 MiB pages (prefer falls back to base pages) [default: the agent's]",
)
@click.option("--populate", is_flag=True, help="every page faulted in before CMD starts")
@click.option(
    "--tenant",
    default=None,
    callback=_wire_name(
        TenantName,
        "tenant name",
        "1 to 128 letters, digits, '_', '.' or '-', starting with a letter or digit",
    ),
    help="tenant to lease for (default: the one uid's)",
)
@click.option("--ttl", "ttl_s", type=click.IntRange(min=1), default=60, show_default=True)
@click.option("--label", "labels", multiple=True, callback=_labels, metavar="KEY=VALUE")
@click.option(
    "--wait", "wait_s", type=click.FloatRange(min=0), default=0.0, help="wait for capacity (s)"
)
@click.option(
    "--revoke-signal",
    default="TERM",
    show_default=True,
    callback=_signal_option,
    help="sent to CMD when poolrun hears of a revocation ('none': send nothing)",
)
@click.option(
    "--socket",
    "socket_path",
    envvar="POOLD_AGENT_SOCKET",
    default=None,
    help="agent socket [env POOLD_AGENT_SOCKET]",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="warning",
    show_default=True,
)
@click.version_option(__version__, prog_name="poolrun", message="%(prog)s %(version)s")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def main(
    size: int,
    media: str | None,
    numa_node: int | None,
    hugepages: str | None,
    populate: bool,
    tenant: str | None,
    ttl_s: int,
    labels: dict[str, str],
    wait_s: float,
    revoke_signal: signal.Signals | None,
    socket_path: str | None,
    log_level: str,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND with a lease of pool memory it finds at $POOLD_LEASE_PATH."""
    setup_logging(log_level.lower())
    request = LeaseRequest(
        size_bytes=size,
        ttl_s=ttl_s,
        media=media,
        tenant=tenant,
        labels=labels,
        wait_s=wait_s,
        numa_node=numa_node,
        hugepages=hugepages,
        populate=populate,
    )
    sys.exit(run(command, request, socket_path=socket_path, revoke_signal=revoke_signal))


if __name__ == "__main__":
    main()
