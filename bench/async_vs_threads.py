"""Would async SQLAlchemy (psycopg's async driver) serve poold better than worker threads?

    .venv/bin/pip install -e ".[bench]"   # greenlet, for async SQLAlchemy
    .venv/bin/python bench/async_vs_threads.py [--database-url URL] [--concurrency 8,32,128]
                                               [--operations 2000] [--json]

The same representative transaction under both models, on PostgreSQL (a throwaway
server from tests/pg.py unless `--database-url` names one), in one asyncio loop as
uvicorn runs poold:

- threads: what poold/api/app.py does. A sync engine (psycopg), the transaction in a
  worker thread via `anyio.to_thread.run_sync` under a CapacityLimiter as wide as the
  pool.
- async: `create_async_engine("postgresql+psycopg://...")`, the same statements
  awaited on the loop.

Both pools are SQLAlchemy's default size (5 + 10 overflow). The transaction is the
grant path's shape, on its own small tables so the ledger is not ported: read the
tenant, sum its live leases, read the host's device and its generation, insert the
lease, bump the device's generation (`WHERE generation = :g`; a miss rolls back and
retries). Each of C concurrent callers has its own host, as agents do.

Per model and C: transactions/s, latency p50/p99 (ms, from the caller, queueing
included) and CPU per transaction of this process (ms): the cost poold pays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import psycopg
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import pg  # after the path fix above

HOSTS = 128
SCHEMA = [
    "CREATE TABLE b_tenant (id serial PRIMARY KEY, name text UNIQUE, quota_bytes bigint)",
    "CREATE TABLE b_device (id serial PRIMARY KEY, host_id int UNIQUE, generation int,"
    " free_bytes bigint)",
    "CREATE TABLE b_lease (id uuid PRIMARY KEY, tenant_id int, device_id int,"
    " size_bytes bigint, state text, created_at timestamptz DEFAULT now())",
    "CREATE INDEX b_lease_tenant ON b_lease (tenant_id, state)",
]
TENANT = text("SELECT id, quota_bytes FROM b_tenant WHERE name = :name")
USAGE = text(
    "SELECT COALESCE(SUM(size_bytes), 0), COUNT(*) FROM b_lease"
    " WHERE tenant_id = :tenant_id AND state = 'live'"
)
DEVICE = text("SELECT id, generation, free_bytes FROM b_device WHERE host_id = :host_id")
INSERT = text(
    "INSERT INTO b_lease (id, tenant_id, device_id, size_bytes, state)"
    " VALUES (:id, :tenant_id, :device_id, :size_bytes, 'live')"
)
BUMP = text(
    "UPDATE b_device SET generation = generation + 1, free_bytes = free_bytes - :size_bytes"
    " WHERE id = :id AND generation = :generation"
)
SIZE_BYTES = 2 << 20


class Miss(Exception):
    """Another writer bumped the generation first: roll back, retry."""


def _params(caller: int) -> dict[str, Any]:
    return {"name": f"t{caller % 8}", "host_id": caller % HOSTS, "size_bytes": SIZE_BYTES}


def sync_txn(conn: Connection, caller: int) -> None:
    p = _params(caller)
    tenant = conn.execute(TENANT, p).one()
    conn.execute(USAGE, {"tenant_id": tenant.id}).one()
    device = conn.execute(DEVICE, p).one()
    conn.execute(
        INSERT,
        {"id": uuid.uuid4(), "tenant_id": tenant.id, "device_id": device.id, **p},
    )
    bumped = conn.execute(BUMP, {"id": device.id, "generation": device.generation, **p})
    if bumped.rowcount != 1:
        raise Miss


async def async_txn(conn: AsyncConnection, caller: int) -> None:
    p = _params(caller)
    tenant = (await conn.execute(TENANT, p)).one()
    (await conn.execute(USAGE, {"tenant_id": tenant.id})).one()
    device = (await conn.execute(DEVICE, p)).one()
    await conn.execute(
        INSERT,
        {"id": uuid.uuid4(), "tenant_id": tenant.id, "device_id": device.id, **p},
    )
    bumped = await conn.execute(BUMP, {"id": device.id, "generation": device.generation, **p})
    if bumped.rowcount != 1:
        raise Miss


def setup(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for table in ("b_lease", "b_device", "b_tenant"):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        for stmt in SCHEMA:
            conn.exec_driver_sql(stmt)
        for i in range(8):
            conn.execute(
                text("INSERT INTO b_tenant (name, quota_bytes) VALUES (:n, :q)"),
                {"n": f"t{i}", "q": 1 << 50},
            )
        for h in range(HOSTS):
            conn.execute(
                text("INSERT INTO b_device (host_id, generation, free_bytes) VALUES (:h, 0, :f)"),
                {"h": h, "f": 1 << 50},
            )
    engine.dispose()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def drive(
    concurrency: int, operations: int, one: Callable[[int], Awaitable[int]]
) -> dict[str, Any]:
    latencies: list[float] = []
    retries = 0
    per_caller = operations // concurrency

    async def caller(i: int) -> None:
        nonlocal retries
        for _ in range(per_caller):
            t0 = time.perf_counter()
            retries += await one(i)
            latencies.append(time.perf_counter() - t0)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = len(latencies)
    return {
        "txn_per_s": round(n / wall, 1),
        "p50_ms": round(pct(latencies, 0.5) * 1000, 2),
        "p99_ms": round(pct(latencies, 0.99) * 1000, 2),
        "cpu_ms_per_txn": round(cpu / n * 1000, 3),
        "retries": retries,
    }


async def run_threads(url: str, concurrency: int, operations: int) -> dict[str, Any]:
    engine = create_engine(url, pool_size=5, max_overflow=10)
    limiter = anyio.CapacityLimiter(15)

    def txn(caller: int) -> int:
        for attempt in range(10):
            try:
                with engine.begin() as conn:
                    sync_txn(conn, caller)
                return attempt
            except Miss:
                continue
        raise RuntimeError("10 misses")

    async def one(caller: int) -> int:
        return await anyio.to_thread.run_sync(txn, caller, limiter=limiter)

    await drive(15, 150, one)  # warm the pool
    try:
        return await drive(concurrency, operations, one)
    finally:
        engine.dispose()


async def run_async(url: str, concurrency: int, operations: int) -> dict[str, Any]:
    engine = create_async_engine(url, pool_size=5, max_overflow=10)

    async def one(caller: int) -> int:
        for attempt in range(10):
            try:
                async with engine.begin() as conn:
                    await async_txn(conn, caller)
                return attempt
            except Miss:
                continue
        raise RuntimeError("10 misses")

    await drive(15, 150, one)
    try:
        return await drive(concurrency, operations, one)
    finally:
        await engine.dispose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--database-url", help="PostgreSQL (postgresql+psycopg://...)")
    ap.add_argument("--concurrency", default="8,32,128")
    ap.add_argument("--operations", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    server = None
    url = args.database_url
    if url is None:
        server = pg.start_server()
        with psycopg.connect(
            f"host=127.0.0.1 port={server.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute("CREATE DATABASE bench_async")
        url = server.url("bench_async")
    results: list[dict[str, Any]] = []
    try:
        setup(url)
        for c in (int(x) for x in args.concurrency.split(",")):
            for model, run in (("threads", run_threads), ("async", run_async)):
                r = {"model": model, "concurrency": c, **asyncio.run(run(url, c, args.operations))}
                results.append(r)
                if not args.json:
                    print(
                        f"{model:8} C={c:<4} {r['txn_per_s']:8.1f} txn/s  p50 {r['p50_ms']:7.2f} ms"
                        f"  p99 {r['p99_ms']:7.2f} ms  cpu {r['cpu_ms_per_txn']:.3f} ms/txn"
                        f"  retries {r['retries']}",
                        flush=True,
                    )
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
