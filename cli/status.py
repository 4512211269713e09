"""`poolctl status`: how much far memory the pool has, per host and device, and how much is free.

One call to ``GET /v1/status``, printed as a hosts table, a devices table and a pool total.
"""

from __future__ import annotations

import click

from cli.common import Ctx, emit_json, json_option, pass_ctx, run, table, wants_json
from cli.units import format_size


@click.command("status")
@json_option
@pass_ctx
def status(c: Ctx, as_json: bool) -> None:
    """Capacity per host and device: total, leased, delegated (reserved for a host's agent,
    not leased yet), free."""
    st = run(lambda: c.client.status())
    if wants_json(as_json):
        emit_json(st)
        return
    table(
        "hosts",
        ["host", "status", "capacity", "leased", "delegated", "free", "leases"],
        [
            (
                h.name,
                h.status,
                format_size(h.capacity_bytes),
                format_size(h.leased_bytes),
                format_size(h.delegated_bytes),
                format_size(h.free_bytes),
                h.live_leases,
            )
            for h in st.hosts
        ],
    )
    table(
        "devices",
        [
            "device",
            "kind",
            "media",
            "state",
            "health",
            "hosts",
            "capacity",
            "leased",
            "delegated",
            "free",
            "leases",
        ],
        [
            (
                d.uid,
                d.kind,
                d.media + (" (recycled)" if d.recycled else ""),
                d.state,
                d.health,
                ",".join(d.hosts),
                format_size(d.capacity_bytes),
                format_size(d.leased_bytes),
                format_size(d.delegated_bytes),
                format_size(d.free_bytes),
                d.live_leases,
            )
            for d in st.devices
        ],
    )
    click.echo(
        f"pool: {format_size(st.capacity_bytes)} total, {format_size(st.leased_bytes)} "
        f"leased, {format_size(st.delegated_bytes)} delegated, {format_size(st.free_bytes)} free"
    )
