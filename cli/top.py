"""`poolctl top`: how the pool is doing right now, refreshed until interrupted.

Every `--interval` seconds one frame: per device leased and free bytes, live leases
per tenant, the devices and hosts draining, and grant and end rates. The rates come
from successive snapshots of the live leases: a lease id new since the last frame
was granted, one gone from it ended (released, reclaimed or aborted). A lease granted
and ended between two frames is seen by neither, so the rates are a floor; the first
frame has none. On a terminal the frame redraws in place (rich Live); piped, each
frame is printed after the last (plain text, or one JSON object a line with --json).
`--iterations N` stops after N frames; Ctrl-C stops cleanly, exit 0.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import click
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from cli.common import (
    MAX_LEASES_PER_CALL,
    Ctx,
    json_option,
    make_table,
    output_format,
    pass_ctx,
    run,
    table,
)
from cli.units import format_size
from poold.wire.admin import PoolStatus
from poold.wire.common import LeaseOut

sleep = time.sleep  # module attribute: the tests replace it to interrupt a frame


@dataclass(frozen=True)
class Snapshot:
    """What one frame is computed from: when (monotonic seconds), the status, live leases."""

    at_s: float
    status: PoolStatus
    live: list[LeaseOut]


@dataclass(frozen=True)
class DeviceLine:
    uid: str
    state: str
    capacity_bytes: int
    leased_bytes: int
    free_bytes: int
    live_leases: int


@dataclass(frozen=True)
class TenantLine:
    tenant: str
    live_leases: int
    leased_bytes: int


@dataclass(frozen=True)
class Frame:
    """One refresh of `poolctl top`, as plain values."""

    at: str  # wall clock, ISO 8601
    capacity_bytes: int
    leased_bytes: int
    free_bytes: int
    live_leases: int
    devices: list[DeviceLine]
    tenants: list[TenantLine]
    draining_devices: list[str]
    draining_hosts: list[str]
    # Over the time since the previous frame; None on the first.
    interval_s: float | None
    granted: int | None
    ended: int | None
    granted_per_s: float | None
    ended_per_s: float | None
    truncated: bool  # more live leases than one list call returns: counts are a floor


def frame(prev: Snapshot | None, cur: Snapshot, wall: datetime) -> Frame:
    """The frame for `cur`, with rates against `prev` (pure: no I/O)."""
    st = cur.status
    per_tenant = Counter(x.tenant for x in cur.live)
    bytes_tenant: Counter[str] = Counter()
    for x in cur.live:
        bytes_tenant[x.tenant] += x.length_bytes
    interval = granted = ended = None
    granted_per_s = ended_per_s = None
    if prev is not None:
        before = {x.id for x in prev.live}
        now = {x.id for x in cur.live}
        granted, ended = len(now - before), len(before - now)
        interval = cur.at_s - prev.at_s
        if interval > 0:
            granted_per_s, ended_per_s = granted / interval, ended / interval
    return Frame(
        at=wall.isoformat(timespec="seconds"),
        capacity_bytes=st.capacity_bytes,
        leased_bytes=st.leased_bytes,
        free_bytes=st.free_bytes,
        live_leases=len(cur.live),
        devices=[
            DeviceLine(
                d.uid, d.state, d.capacity_bytes, d.leased_bytes, d.free_bytes, d.live_leases
            )
            for d in st.devices
        ],
        tenants=[
            TenantLine(t, per_tenant[t], bytes_tenant[t])
            for t in sorted(per_tenant, key=lambda t: (-bytes_tenant[t], t))
        ],
        draining_devices=[d.uid for d in st.devices if d.state == "draining"],
        draining_hosts=[h.name for h in st.hosts if h.status == "draining"],
        interval_s=interval,
        granted=granted,
        ended=ended,
        granted_per_s=granted_per_s,
        ended_per_s=ended_per_s,
        truncated=len(cur.live) >= MAX_LEASES_PER_CALL,
    )


def _rate(n: int | None, per_s: float | None) -> str:
    if n is None:
        return "-"
    return f"{n} ({per_s:.2f}/s)" if per_s is not None else str(n)


def summary(f: Frame) -> list[str]:
    """The frame's header lines: pool totals, rates, what is draining."""
    lines = [
        f"poolctl top {f.at}: {format_size(f.capacity_bytes)} total, "
        f"{format_size(f.leased_bytes)} leased, {format_size(f.free_bytes)} free; "
        f"{f.live_leases} live lease(s)" + (" (at least)" if f.truncated else ""),
    ]
    since = (
        f"in the last {f.interval_s:.1f}s"
        if f.interval_s is not None
        else "(rates from the second frame on)"
    )
    lines.append(
        f"granted {_rate(f.granted, f.granted_per_s)}, ended "
        f"{_rate(f.ended, f.ended_per_s)} {since}"
    )
    lines.append(
        "draining: "
        + (
            "; ".join(
                part
                for part in (
                    f"devices {', '.join(f.draining_devices)}" if f.draining_devices else "",
                    f"hosts {', '.join(f.draining_hosts)}" if f.draining_hosts else "",
                )
                if part
            )
            or "nothing"
        )
    )
    return lines


DEVICE_COLUMNS = ["device", "state", "capacity", "leased", "free", "leases"]
TENANT_COLUMNS = ["tenant", "leases", "leased"]


def _device_rows(f: Frame) -> list[tuple[object, ...]]:
    return [
        (
            d.uid,
            d.state,
            format_size(d.capacity_bytes),
            format_size(d.leased_bytes),
            format_size(d.free_bytes),
            d.live_leases,
        )
        for d in f.devices
    ]


def _tenant_rows(f: Frame) -> list[tuple[object, ...]]:
    return [(t.tenant, t.live_leases, format_size(t.leased_bytes)) for t in f.tenants]


def renderable(f: Frame) -> Group:
    """The frame for rich Live: header lines, then the device and tenant tables."""
    return Group(
        *[Text(line) for line in summary(f)],
        make_table("devices", DEVICE_COLUMNS, _device_rows(f)),
        make_table("live leases per tenant", TENANT_COLUMNS, _tenant_rows(f)),
    )


def print_plain(f: Frame) -> None:
    for line in summary(f):
        click.echo(line)
    click.echo("")
    # Byte counts and lease counts are right-aligned by common's default.
    table("devices", DEVICE_COLUMNS, _device_rows(f))
    table("live leases per tenant", TENANT_COLUMNS, _tenant_rows(f))


@click.command("top")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="seconds between frames",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    default=None,
    help="stop after N frames (default: until Ctrl-C)",
)
@json_option
@pass_ctx
def top(c: Ctx, interval: float, iterations: int | None, as_json: bool) -> None:
    """The pool live: per device leased and free, leases per tenant, grant and end rates."""
    fmt = output_format(as_json)
    prev: Snapshot | None = None

    def next_frame() -> Frame:
        nonlocal prev
        st = run(lambda: c.client.status())
        live = run(lambda: c.client.list_leases(live=True, limit=MAX_LEASES_PER_CALL))
        cur = Snapshot(time.monotonic(), st, live)
        out = frame(prev, cur, datetime.now(UTC))
        prev = cur
        return out

    def more(shown: int) -> bool:
        if iterations is not None and shown >= iterations:
            return False
        sleep(interval)
        return True

    shown = 0
    try:
        if fmt == "table":
            with Live(renderable(next_frame()), console=Console(), auto_refresh=False) as live:
                shown = 1
                while more(shown):
                    live.update(renderable(next_frame()), refresh=True)
                    shown += 1
            return
        while True:
            f = next_frame()
            if fmt == "json":
                click.echo(json.dumps(asdict(f), sort_keys=True))
            else:
                print_plain(f)
            shown += 1
            if not more(shown):
                return
    except KeyboardInterrupt:
        return  # Ctrl-C is how top is meant to end
