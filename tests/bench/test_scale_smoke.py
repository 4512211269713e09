"""bench/scale.py runs end to end with tiny parameters and reports what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pg
from tests.conftest import drop_pg_database, new_pg_database

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--poolds",
    "1",
    "--clients",
    "2",
    "--operations",
    "50",
    "--hosts",
    "1",
    "--tenants",
    "4",
    "--host-capacity",
    "512MiB",
    "--heartbeat-items",
    "2000",
    "--json",
]
PHASE_FIGURES = (
    "grants_per_s",
    "grant_p50_ms",
    "grant_p99_ms",
    "poold_cpu_ms_per_grant",
    "agent_cpu_ms_per_grant",
    "health_p50_ms",
    "health_p99_ms",
    "floor_write_p50_ms",
    "floor_health_p50_ms",
    "grant_p50_over_write_floor",
)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def ledger_args(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    if request.param == "sqlite":
        yield ["--sqlite"]
        return
    server: pg.PgServer = request.getfixturevalue("pg_server")
    name = new_pg_database(server, None)  # empty: the bench migrates it
    yield ["--database-url", server.url(name)]
    drop_pg_database(server, name)


def test_scale_smoke(ledger_args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), *ledger_args, *TINY],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["invariants_ok"] is True
    [phase] = result["phases"]
    assert (phase["poolds"], phase["clients"], phase["operations"]) == (1, 2, 50)
    assert phase["attempts"] == 50
    assert phase["grants"] > 0
    assert phase["grants"] + sum(phase["errors"].values()) == 50
    for key in PHASE_FIGURES:
        assert isinstance(phase[key], float), key
    assert phase["invariants"]["violations"] == []
    assert all(phase["invariants"]["checks"].values())
    assert phase["invariants"]["leases_checked"] == phase["grants"]
    [probe] = result["heartbeat_probes"]
    assert probe["items"] == 2000 and probe["error"] is None
    assert probe["refused"] == 2000  # renewals of leases that do not exist
    assert probe["health_p99_ms"] is not None
    assert {t["target"] for t in result["targets"]} >= {
        "poold CPU per grant <= 1.5 ms",
        "grant p99 <= 100 ms at 128 clients",
        "/v1/health p99 <= 50 ms during a 100,000-item heartbeat",
    }
    assert all(isinstance(t["met"], bool) for t in result["targets"])
