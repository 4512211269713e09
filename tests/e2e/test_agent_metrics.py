"""`pool-agent serve --metrics-listen HOST:PORT` serves the agent's metrics; a bad address
stops it at start with a one-line configuration error."""

from __future__ import annotations

import subprocess
import sys

import httpx

from agent.client import PoolClient
from poold import procs
from tests.e2e.conftest import AGENT_CAPACITY, Cluster

HOST = "metrics-host"


def test_the_agent_serves_its_metrics_where_it_is_told(cluster: Cluster) -> None:
    c = cluster
    cred = c.work / f"{HOST}.credential"
    cred.write_text(c.admin.add_host(HOST).credential)
    sock = c.socket_path.parent / f"{HOST}.sock"
    port = procs.free_port()
    agent = procs.start_agent(
        c.work,
        host=HOST,
        poold_url=c.url,
        credential_file=cred,
        socket_path=sock,
        emulated_capacity_bytes=AGENT_CAPACITY,
        heartbeat_interval_s=0.2,
        extra=["--metrics-listen", f"127.0.0.1:{port}"],
    )
    try:
        with PoolClient(sock) as client:
            lease = client.lease(4 << 20, renew=False)
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            lease.release()
    finally:
        agent.stop()
    assert 'pool_agent_leases_held{backend="emulated"} 1.0' in text
    assert "pool_agent_socket_connections 1.0" in text
    assert "pool_agent_materialise_duration_seconds_count" in text


def test_a_bad_metrics_address_is_a_config_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--metrics-listen", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "error[config_invalid]" in out.stderr and "metrics_listen" in out.stderr
