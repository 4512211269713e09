"""How does an administrator see what the agent discovered? (``pool-agent inventory``)

Prints the pool devices as a table, or with ``--json`` the whole inventory. JSON field
names and units follow ``cxl list`` and ``daxctl list`` where they overlap (``memdev``,
``ram_size``, ``interleave_ways``, ``chardev``, ``target_node``, bytes as integers), so
output can be checked against those tools.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agent.discovery.inventory import Inventory, discover


def _bytes(value: int) -> str:
    """Human size the way daxctl -u prints it, in binary units."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift:
            return f"{value / (1 << shift):.2f} {unit}"
    return f"{value} B"


def render_table(inv: Inventory, console: Console) -> None:
    """Pool devices, then what was found underneath and any warnings."""
    table = Table(title=f"pool devices ({inv.sysfs_root})")
    for column in ("local", "kind", "node", "tier", "capacity", "media", "health"):
        table.add_column(column)
    # The uid is long; it goes last and is the only column that wraps.
    table.add_column("uid", overflow="fold")
    for d in inv.devices:
        table.add_row(
            d.local_name,
            d.kind,
            "-" if d.numa_node is None else str(d.numa_node),
            "-" if d.memory_tier is None else str(d.memory_tier),
            _bytes(d.capacity_bytes),
            d.media + (" (recycled)" if d.recycled else ""),
            d.health,
            escape(d.uid),
        )
    console.print(table)
    console.print(
        f"memdevs: {len(inv.cxl.memdevs)}  cxl regions: {len(inv.cxl.regions)}  "
        f"dax regions: {len(inv.dax.regions)}  dax devices: {len(inv.dax.devices())}  "
        f"nodes: {len(inv.numa.nodes)}  health: {inv.health.tool}"
    )
    for warning in inv.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)


def inventory_json(inv: Inventory) -> str:
    """The inventory as JSON; unknown fields are left out, as cxl/daxctl list do."""
    return json.dumps(inv.model_dump(mode="json", exclude_none=True), indent=2)


def inventory(sysfs_root: Path, as_json: bool) -> None:
    """Discover and print (the body of the click command, callable from tests)."""
    inv = discover(sysfs_root)
    if as_json:
        click.echo(inventory_json(inv))
    else:
        # emoji=False: rich would turn the ":ram:" inside uids into a sheep.
        render_table(inv, Console(emoji=False, highlight=False))


@click.command("inventory")
@click.option(
    "--sysfs-root",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=Path("/sys"),
    show_default=True,
    help="sysfs to read (a recorded machine tree in tests).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the whole inventory as JSON.")
def inventory_command(sysfs_root: Path, as_json: bool) -> None:
    """Show the far memory this host can offer the pool."""
    inventory(sysfs_root, as_json)
