"""`poolctl devices`: what far memory the pool has, and what administrators say about it.

Lists every device poold knows (kind, media, recycled, capacity, free, NUMA node, health,
state) from ``GET /v1/status``; ``annotate`` records what sysfs cannot tell (media class,
recycled DIMMs, provenance, cost), which wins over what agents report; ``drain`` stops
placing leases on a device and revokes its leases at a deadline, ``undrain`` undoes it
(both succeed when there is nothing to do, and say so); ``map`` draws where on each
device the leases, quarantined and reserved ranges and free holes lie (cli/devmap.py).
"""

from __future__ import annotations

from typing import Any

import click
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text

from cli import device_hosts, devmap
from cli.common import (
    MAX_LEASES_PER_CALL,
    MEDIA_CLASS,
    Ctx,
    describe_validation,
    emit_drained,
    emit_json,
    exclusive,
    fail,
    json_option,
    key_values,
    output_format,
    pass_ctx,
    run,
    stdout_is_terminal,
    table,
    wants_json,
)
from cli.units import format_size
from poold.errors import BadRequest, UnknownDevice
from poold.wire.admin import DeviceAnnotate, DeviceStatus

ANNOTATION_FIELDS = ("media", "recycled", "provenance", "cost_per_gib_month")


def _media(d: DeviceStatus) -> str:
    return d.media + (" (recycled)" if d.recycled else "")


def _health(d: DeviceStatus) -> str:
    return d.health if not d.health_reasons else f"{d.health}: {'; '.join(d.health_reasons)}"


def _ranges(total_bytes: int, ranges: list[tuple[int, int]]) -> str:
    """Their bytes, then each range as [start, end) in sizes: "64.0 MiB: [0 B, 64.0 MiB)"."""
    if not ranges:
        return "-"
    text = ", ".join(
        f"[{format_size(offset)}, {format_size(offset + length)})" for offset, length in ranges
    )
    return f"{format_size(total_bytes)}: {text}"


def _reserved(d: DeviceStatus) -> str:
    return _ranges(d.reserved_bytes, d.reserved_extents)


def _delegated(d: DeviceStatus) -> str:
    """Unleased reserved bytes, then each reservation: "[start, end) host (unleased)"."""
    if not d.delegations:
        return "-"
    text = ", ".join(
        f"[{format_size(x.offset_bytes)}, {format_size(x.offset_bytes + x.length_bytes)}) "
        f"{x.host} ({format_size(x.unleased_bytes)} unleased"
        + (", returning)" if x.state != "held" else ")")
        for x in d.delegations
    )
    return f"{format_size(d.delegated_bytes)}: {text}"


def device_rows(items: list[DeviceStatus]) -> list[tuple[Any, ...]]:
    return [
        (
            d.id,
            d.uid,
            d.kind,
            d.media,
            "yes" if d.recycled else "no",
            format_size(d.capacity_bytes),
            format_size(d.delegated_bytes),
            format_size(d.free_bytes),
            d.numa_node,
            d.memory_tier,
            _health(d),
            d.state,
            ",".join(d.hosts) or "-",
        )
        for d in items
    ]


RIGHT_ALIGNED = {"id", "capacity", "delegated", "free", "node", "tier"}


def print_devices(items: list[DeviceStatus]) -> None:
    table(
        "devices",
        [
            "id",
            "device",
            "kind",
            "media",
            "recycled",
            "capacity",
            "delegated",
            "free",
            "node",
            "tier",
            "health",
            "state",
            "hosts",
        ],
        device_rows(items),
        right=RIGHT_ALIGNED,
    )


def resolve(items: list[DeviceStatus], name: str) -> DeviceStatus:
    """A device by uid, numeric id, local name (``dax_region0``) or ``host:local name``."""
    for d in items:
        if d.uid == name or str(d.id) == name:
            return d
    host, _, local = name.rpartition(":")
    matches = [
        d
        for d in items
        if name in d.local_names or (host in d.hosts and local and local in d.local_names)
    ]
    if len(matches) == 1:
        return matches[0]
    if matches:
        fail(
            BadRequest(
                f"{name!r} names several devices ({', '.join(d.uid for d in matches)}); "
                "use the uid or the id",
                name=name,
            )
        )
    fail(UnknownDevice(f"no device {name!r} (see `poolctl devices`)", name=name))


def show_one(d: DeviceStatus, as_json: bool) -> None:
    if wants_json(as_json):
        emit_json(d)
        return
    admin = d.admin_annotations.model_dump(exclude_none=True)
    rows: list[tuple[str, Any]] = [
        ("id", d.id),
        ("uid", d.uid),
        ("kind", d.kind),
        ("media", _media(d)),
        ("provenance", d.provenance),
        ("cost per GiB-month", d.cost_per_gib_month),
        ("annotated by admin", ", ".join(sorted(admin)) or "-"),
        ("state", d.state),
        ("health", _health(d)),
        ("capacity", format_size(d.capacity_bytes)),
        ("leased", format_size(d.leased_bytes)),
        # Held by dax devices poold did not place (the kernel's dax0.0, daxctl): never leased.
        ("reserved", _reserved(d)),
        # Never allocated again: media poison, a failed scrub, a deleted host's unzeroed range.
        ("quarantined", _ranges(d.quarantined_bytes, d.quarantined_extents)),
        # Reserved for a host whose agent grants inside alone: bytes no lease there uses yet.
        ("delegated", _delegated(d)),
        ("free", format_size(d.free_bytes)),
        ("largest free", format_size(d.largest_free_bytes)),
        ("alignment", format_size(d.alignment_bytes)),
        ("live leases", d.live_leases),
        ("NUMA node", d.numa_node),
        ("memory tier", d.memory_tier),
        ("memdev serials", ",".join(str(s) for s in d.memdev_serials) or "-"),
        ("hosts", ",".join(d.hosts) or "-"),
        ("local names", ",".join(d.local_names) or "-"),
    ]
    key_values("", rows)


@click.group("devices", invoke_without_command=True)
@json_option
@click.pass_context
def devices(ctx: click.Context, as_json: bool) -> None:
    """Far-memory devices: kind, media, recycled, capacity, free, NUMA node, health, state."""
    if ctx.invoked_subcommand is not None:
        return
    c = ctx.find_object(Ctx)
    assert c is not None  # poolctl's main group always sets it
    st = run(lambda: c.client.status())
    if wants_json(as_json):
        emit_json(st.devices)
        return
    print_devices(st.devices)


@devices.command("show")
@click.argument("device")
@json_option
@pass_ctx
def devices_show(c: Ctx, device: str, as_json: bool) -> None:
    """One device in full (by uid, id or local name)."""
    st = run(lambda: c.client.status())
    show_one(resolve(st.devices, device), as_json)


@devices.command("annotate")
@click.argument("device")
@click.option("--media", type=MEDIA_CLASS, default=None, help="media class: ddr4, ddr5, hbm, ...")
@click.option("--recycled/--not-recycled", default=None, help="whether the DIMMs are recycled")
@click.option("--provenance", default=None, help='where it came from: "rack 12 host 7"')
@click.option("--cost-per-gib-month", type=click.FloatRange(min=0), default=None, help="cost basis")
@click.option(
    "--clear",
    "clear",
    multiple=True,
    type=click.Choice(ANNOTATION_FIELDS),
    help="drop the admin's value of a field (the agent's applies again); repeatable",
)
@json_option
@pass_ctx
def devices_annotate(
    c: Ctx,
    device: str,
    media: str | None,
    recycled: bool | None,
    provenance: str | None,
    cost_per_gib_month: float | None,
    clear: tuple[str, ...],
    as_json: bool,
) -> None:
    """Say what sysfs cannot tell; it wins over what the host's agent reports."""
    fields: dict[str, Any] = {
        "media": media,
        "recycled": recycled,
        "provenance": provenance,
        "cost_per_gib_month": cost_per_gib_month,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    if not fields and not clear:
        raise click.UsageError(
            "nothing to annotate: give --media, --recycled/--not-recycled, --provenance, "
            "--cost-per-gib-month or --clear"
        )
    try:
        change = DeviceAnnotate.model_validate({**fields, "clear": list(clear)})
    except ValidationError as exc:  # e.g. --media ddr4 with --clear media
        fail(BadRequest(f"invalid annotation: {describe_validation(exc)}"))
    st = run(lambda: c.client.status())
    target = resolve(st.devices, device)
    out = run(lambda: c.client.annotate_device(target.uid, change))
    show_one(out, as_json)


@devices.command("drain")
@click.argument("device")
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="live leases are revoked after this long",
)
@click.option("--now", "now_", is_flag=True, help="revoke the live leases at once")
@json_option
@click.pass_context
def devices_drain(
    ctx: click.Context, device: str, deadline_s: float, now_: bool, as_json: bool
) -> None:
    """Stop placing leases on a device; revoke its leases at the deadline (or --now).

    Draining again never postpones: the earliest deadline set stands (a shorter one
    brings it forward) and a repeat that changes nothing says so (`changed: false`).
    """
    exclusive(ctx, "deadline_s", "now_")
    c = ctx.find_object(Ctx)
    assert c is not None  # poolctl's main group always sets it
    target = resolve(run(lambda: c.client.status()).devices, device)
    emit_drained(
        run(lambda: c.client.drain_device(target.uid, deadline_s=deadline_s, now=now_)), as_json
    )


@devices.command("undrain")
@click.argument("device")
@json_option
@pass_ctx
def devices_undrain(c: Ctx, device: str, as_json: bool) -> None:
    """Put a draining device back online (a device not draining is left as it is)."""
    target = resolve(run(lambda: c.client.status()).devices, device)
    emit_drained(run(lambda: c.client.undrain_device(target.uid)), as_json)


@devices.command("map")
@click.argument("device", required=False)
@click.option(
    "--width",
    type=click.IntRange(min=1, max=10_000),
    default=None,
    help="cells per device (default: the terminal's width, 80 when piped)",
)
@json_option
@pass_ctx
def devices_map(c: Ctx, device: str | None, width: int | None, as_json: bool) -> None:
    """Where leases (per tenant), quarantined and reserved ranges and free holes lie.

    One strip per device (or just DEVICE): each cell is the kind holding most of its
    bytes, then free bytes, the largest free extent and its share of the free bytes.
    --json lists every extent (offset, length, kind, tenant, lease), always as a list.
    """
    st = run(lambda: c.client.status())
    items = [resolve(st.devices, device)] if device is not None else st.devices
    live = run(lambda: c.client.list_leases(live=True, limit=MAX_LEASES_PER_CALL))
    fmt = output_format(as_json)
    console = Console()
    if width is None:
        width = max(console.width - 2, 10) if fmt == "table" and stdout_is_terminal() else 80
    maps = [devmap.build(d, live, width) for d in items]
    if fmt == "json":
        emit_json([devmap.as_json(m) for m in maps])
        return
    colour = fmt == "table"
    legend = devmap.Legend([s.tenant for m in maps for s in m.spans if s.tenant is not None])

    def say(text: str | Text) -> None:
        if colour:
            # Text, not str: uids ("cxl:ram:...") must not become markup or emoji.
            console.print(Text(text) if isinstance(text, str) else text, soft_wrap=True)
        else:
            click.echo(str(text))

    if len(live) >= MAX_LEASES_PER_CALL:
        say(f"warning: only the newest {MAX_LEASES_PER_CALL} live leases are drawn")
    if not maps:
        say("no devices")
        return
    for m in maps:
        say(devmap.heading(m))
        say(devmap.strip_text(m, legend, colour=colour))
        say(devmap.figures(m))
        say("")
    say(devmap.legend_text(legend, colour=colour, totals=devmap.tenant_totals(maps)))


for _command in device_hosts.COMMANDS:  # allow-host, disallow-host (cli/device_hosts.py)
    devices.add_command(_command)
