"""One reclamation audit over a ledger of 100,000 leases across 1,000 devices.

    .venv/bin/python bench/audit.py [--leases 100000] [--devices 1000]
                                    [--database-url URL] [--json]

The ledger is built with bulk Core inserts (100 hosts, 1,000 devices, 100
tenants; leases mostly active, some released, expired or granted, each with
its grant event and one event per later transition), then
`poold.ledger.audit.run_audit` runs once, as `poolctl audit` makes poold do.
Default ledger: SQLite in a temp dir; pass a PostgreSQL URL to bench that.
Target: audit_s <= 10.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
from sqlalchemy import insert

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from poold.ledger import audit, migrate
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DevicePath, Event, Host, Lease, Tenant
from poold.ledger.reaper import ReaperPolicy
from poold.ledger.types import utcnow

TARGET_S = 10.0
MiB = 1 << 20
HOSTS = 100
TENANTS = 100
CHUNK = 10_000


def _chunks(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)]


def build(ledger: Ledger, n_leases: int, n_devices: int) -> int:
    """Fill an empty, migrated ledger; returns the number of events written."""
    now = utcnow()
    per_device = -(-n_leases // n_devices)
    with ledger.write() as s:
        conn = s.connection()
        conn.execute(
            insert(Host),
            [
                {
                    "id": h + 1,
                    "name": f"host-{h:03d}",
                    "status": "up",
                    "credential_hash": uuid.uuid4().hex + uuid.uuid4().hex,
                    "last_heartbeat_at": now,
                    "created_at": now,
                }
                for h in range(HOSTS)
            ],
        )
        conn.execute(
            insert(Device),
            [
                {
                    "id": d + 1,
                    "uid": f"bench/dax{d}",
                    "kind": "devdax",
                    "media": "ddr5",
                    "capacity_bytes": per_device * 8 * MiB,
                    "alignment_bytes": 2 * MiB,
                    "health": "ok",
                    "state": "online",
                    "generation": per_device,
                    "created_at": now,
                    "updated_at": now,
                    "memdev_serials": [],
                    "health_reasons": [],
                    "reported_annotations": {},
                    "admin_annotations": {},
                }
                for d in range(n_devices)
            ],
        )
        conn.execute(
            insert(DevicePath),
            [
                {
                    "device_id": d + 1,
                    "host_id": d % HOSTS + 1,
                    "local_name": f"dax{d}.0",
                    "present": True,
                    "seen_at": now,
                }
                for d in range(n_devices)
            ],
        )
        conn.execute(
            insert(Tenant),
            [
                {
                    "id": t + 1,
                    "name": f"tenant-{t:03d}",
                    "quota_bytes": 1 << 50,
                    "quota_leases": 1 << 30,
                    "allowed_media": [],
                    "allowed_uids": [1000 + t],
                    "allowed_gids": [],
                    "allowed_hosts": [],
                    "generation": 0,
                    "created_at": now,
                }
                for t in range(TENANTS)
            ],
        )
    lease_rows: list[dict[str, Any]] = []
    event_rows: list[dict[str, Any]] = []
    for i in range(n_leases):
        device = i % n_devices
        slot = i // n_devices
        # 80 % active, 10 % released, 5 % expired (within grace), 5 % granted (fresh).
        bucket = i % 20
        state = (
            "released"
            if bucket < 2
            else "expired"
            if bucket == 2
            else "granted"
            if bucket == 3
            else "active"
        )
        lease_id = str(uuid.UUID(int=i + 1))
        tenant = i % TENANTS + 1
        host = device % HOSTS + 1
        lease_rows.append(
            {
                "id": lease_id,
                "tenant_id": tenant,
                "host_id": host,
                "device_id": device + 1,
                "offset_bytes": slot * 8 * MiB,
                "length_bytes": (2 + 2 * (i % 3)) * MiB,
                "requested_bytes": 2 * MiB,
                "state": state,
                "ttl_s": 60,
                "epoch": slot + 1,
                "granted_at": now,
                "activated_at": None if state == "granted" else now,
                "expires_at": now + timedelta(seconds=60 if state != "expired" else -1),
                "ended_at": now if state == "released" else None,
                "holder_uid": 1000,
                "holder_gid": None,
                "holder_pid": 4242,
                "labels": {},
                "exclusive_bytes": 0,
                "replica_bytes": 0,
                "reported_at": None,
            }
        )
        common = {
            "at": now,
            "actor": "agent:bench",
            "lease_id": lease_id,
            "tenant_id": tenant,
            "host_id": host,
            "device_id": device + 1,
            "reason": None,
            "detail": {},
        }
        event_rows.append(
            {**common, "kind": "lease.grant", "from_state": None, "to_state": "granted"}
        )
        if state != "granted":
            event_rows.append(
                {**common, "kind": "lease.activate", "from_state": "granted", "to_state": "active"}
            )
        if state in ("released", "expired"):
            kind = "lease.release" if state == "released" else "lease.expire"
            event_rows.append({**common, "kind": kind, "from_state": "active", "to_state": state})
    with ledger.write() as s:
        conn = s.connection()
        for chunk in _chunks(lease_rows):
            conn.execute(insert(Lease), chunk)
        for chunk in _chunks(event_rows):
            conn.execute(insert(Event), chunk)
    return len(event_rows)


def raw_read(ledger: Ledger) -> int:
    """The floor: fetch every row the audit has to look at, through the bare driver."""
    rows = 0
    with ledger.engine.connect() as conn:
        for table in ("devices", "tenants", "hosts", "quarantine", "leases", "events"):
            rows += len(conn.exec_driver_sql(f"SELECT * FROM {table}").fetchall())  # noqa: S608
    return rows


@click.command()
@click.option("--leases", "n_leases", default=100_000, show_default=True)
@click.option("--devices", "n_devices", default=1_000, show_default=True)
@click.option("--database-url", default=None, help="an EMPTY database (default: temp SQLite)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--runs", default=3, show_default=True, help="audits (medians are reported)")
def main(n_leases: int, n_devices: int, database_url: str | None, as_json: bool, runs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="poold-bench-audit-") as tmp:
        url = database_url or f"sqlite:///{Path(tmp) / 'ledger.db'}"
        migrate.upgrade(url)
        ledger = Ledger(url)
        try:
            t0 = time.perf_counter()
            n_events = build(ledger, n_leases, n_devices)
            build_s = time.perf_counter() - t0
            audits: list[float] = []
            floors: list[float] = []
            for _ in range(runs):  # interleaved with the floor: same machine state
                t0 = time.perf_counter()
                raw_read(ledger)
                floors.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                report = audit.run_audit(ledger, ReaperPolicy())
                audits.append(time.perf_counter() - t0)
            audit_s = statistics.median(audits)
            floor_s = statistics.median(floors)
        finally:
            ledger.dispose()
    result = {
        "leases": report.leases,
        "devices": report.devices,
        "events": n_events,
        "backend": url.split(":", 1)[0],
        "runs": runs,
        "audit_s": round(audit_s, 3),
        "floor_s": round(floor_s, 3),
        "over_floor": round(audit_s / floor_s, 2),
        "build_s": round(build_s, 1),
        "exit_code": report.exit_code,
        "violations": len(report.violations),
        "reclaimable": len(report.reclaimable),
        "pending": len(report.pending),
        "target_s": TARGET_S,
        "ok": audit_s <= TARGET_S,
    }
    if as_json:
        click.echo(json.dumps(result))
    else:
        for key, value in result.items():
            click.echo(f"{key:>12}: {value}")
    if report.violations:
        raise SystemExit(f"the bench ledger broke an invariant: {report.violations[0]}")


if __name__ == "__main__":
    main()
