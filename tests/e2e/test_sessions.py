"""Tenant sessions end to end: poold decides, its agent hears at once (news), the tenant's
callbacks fire at once (pushed events), on real processes.

The agent here heartbeats every 30 s and the tenants never renew (``renew=False``), so
anything a callback hears within a few seconds came by push, not by a renewal reply or
a periodic heartbeat. DESIGN.md "Tenant sessions and pushed events".
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from agent.client import LOST_CONNECTION, Lease, PoolClient
from agent.protocol import (
    LOST_ENDED,
    LOST_REVOKED,
    HelloArgs,
    LeaseArgs,
    RenewArgs,
    encode_request,
    read_frame,
)
from poold.wire.admin import TenantSpec
from tests.e2e.conftest import AGENT_CAPACITY, Cluster, slow_agent

MiB = 1 << 20
HOST = "session-host"
PROMPT_S = 2.0  # how soon a pushed event reaches a callback, news and push included


@dataclass
class Heard:
    """What a lease's callbacks heard, and when (monotonic)."""

    revoked: list[tuple[float, datetime]] = field(default_factory=list)
    shrunk: list[tuple[float, int, datetime]] = field(default_factory=list)
    lost: list[tuple[float, str | None]] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)
    changed: threading.Event = field(default_factory=threading.Event)

    def on_revoke(self, lease: Lease, deadline_at: datetime) -> None:
        self.revoked.append((time.monotonic(), deadline_at))
        self.threads.add(threading.current_thread().name)
        self.changed.set()

    def on_shrink(self, lease: Lease, target_bytes: int, deadline_at: datetime) -> None:
        self.shrunk.append((time.monotonic(), target_bytes, deadline_at))
        self.changed.set()

    def on_lost(self, lease: Lease) -> None:
        self.lost.append((time.monotonic(), lease.lost_reason))
        self.changed.set()

    def wait(self, what: list[object], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not what:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.wait(min(left, 0.05))
            self.changed.clear()
        return True


def lease_with(client: PoolClient, heard: Heard, size_bytes: int = 4 * MiB) -> Lease:
    return client.lease(
        size_bytes,
        ttl_s=120,
        renew=False,
        on_revoke=heard.on_revoke,
        on_shrink=heard.on_shrink,
        on_lost=heard.on_lost,
    )


def test_revoke_is_heard_before_its_deadline_and_the_loss_at_it(any_cluster: Cluster) -> None:
    """(1) ttl 120 s, no renewals, revoked with 10 s: on_revoke within ~2 s; the tenant
    keeps the lease, so at the deadline the agent takes it back and on_lost fires."""
    c = any_cluster
    heard = Heard()
    with slow_agent(c, HOST) as sock, PoolClient(sock, timeout_s=10) as client:
        lease = lease_with(client, heard)
        assert client.in_session
        revoked_at = time.monotonic()
        c.admin.revoke(lease.lease_id, reason="failing DIMM", deadline_s=10)
        deadline = time.time() + 10

        assert heard.wait(heard.revoked, PROMPT_S + 1), "on_revoke never fired"
        at, deadline_at = heard.revoked[0]
        assert at - revoked_at < PROMPT_S
        # The agent's deadline is poold's less its margin: still in the future.
        assert datetime.now(UTC) < deadline_at <= datetime.fromtimestamp(deadline, UTC)
        assert heard.threads == {"poold-events"}  # not the reader: it never stalls replies
        assert lease.revoke_deadline_at == deadline_at
        assert not heard.lost

        assert heard.wait(heard.lost, 15), "on_lost never fired"
        lost_at, reason = heard.lost[0]
        assert reason == LOST_REVOKED and lease.lost
        # At the deadline (taken by the agent's 1 s holder watch), not a renewal later.
        assert 8 <= lost_at - revoked_at <= 12
        assert len(heard.revoked) == 1 and len(heard.lost) == 1
        # The agent has let go: not held, only watched while this process holds its memfd
        # (DESIGN.md "Memory follows the pages"); closing it frees the bytes.
        assert lease.lease_id not in {listed.lease_id for listed in client.list()}
        assert client.stats().revoked_held_leases == 1
        lease.release()
        deadline = time.monotonic() + 5
        while client.stats().revoked_held_leases and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.stats().revoked_held_leases == 0


def test_a_tenant_releasing_in_on_revoke_is_reclaimed_early_and_not_lost(
    any_cluster: Cluster,
) -> None:
    """(2) The engine lets go as soon as it hears: the revocation is done long before the
    deadline, and nothing is lost."""
    c = any_cluster
    heard = Heard()

    def let_go(lease: Lease, deadline_at: datetime) -> None:
        heard.on_revoke(lease, deadline_at)
        lease.release()

    with slow_agent(c, HOST) as sock, PoolClient(sock, timeout_s=10) as client:
        lease = client.lease(
            4 * MiB, ttl_s=120, renew=False, on_revoke=let_go, on_lost=heard.on_lost
        )
        revoked_at = time.monotonic()
        c.admin.revoke(lease.lease_id, reason="drain", deadline_s=20)
        assert heard.wait(heard.revoked, PROMPT_S + 1)
        assert c.wait_state(lease.lease_id, "reclaimed", timeout_s=5) == "reclaimed"
        assert time.monotonic() - revoked_at < 10  # well before the 20 s deadline
        time.sleep(1)
        assert not heard.lost and not lease.lost and lease.released


def test_a_shrink_request_under_pressure_reaches_on_shrink_promptly(cluster: Cluster) -> None:
    """(3) The device runs short: poold asks the lease holding replicas for bytes back,
    and on_shrink hears it (with how much replicas can give) without any renewal."""
    c = cluster
    c.admin.create_tenant(
        TenantSpec(name="big", quota_bytes=AGENT_CAPACITY, allowed_uids=[os.getuid()])
    )
    heard = Heard()
    size = AGENT_CAPACITY - 8 * MiB  # under the 5 % watermark: pressure
    with PoolClient(c.socket_path, timeout_s=10) as client:
        lease = client.lease(
            size,
            tenant="big",
            ttl_s=120,
            renew=False,
            shrinkable=True,
            on_shrink=heard.on_shrink,
            on_lost=heard.on_lost,
        )
        reported_at = time.monotonic()
        assert lease.report(
            used_bytes=size, exclusive_bytes=size - 64 * MiB, replica_bytes=64 * MiB
        )
        assert heard.wait(heard.shrunk, PROMPT_S + 1), "on_shrink never fired"
        at, target_bytes, deadline_at = heard.shrunk[0]
        assert at - reported_at < PROMPT_S
        assert 0 < target_bytes <= 64 * MiB
        assert 0 < lease.shrink_replica_bytes <= 64 * MiB
        assert deadline_at > datetime.now(UTC)
        # Asked again every heartbeat while short, but told once while the ask stands.
        time.sleep(1)
        assert len(heard.shrunk) == 1
        lease.shrink(size - target_bytes)
        assert not heard.lost


def test_a_client_that_never_asked_gets_no_event_frames(cluster: Cluster) -> None:
    """(4) An old-style client (no events in hello): not one unsolicited frame; it still
    learns of the revocation from its renewal."""
    c = cluster
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(c.socket_path))
        sock.sendall(encode_request("hello", HelloArgs(client_name="old")))
        hello = read_frame(sock, max_frame_bytes=1 << 20)
        assert hello is not None and hello["ok"] is True
        sock.sendall(encode_request("lease", LeaseArgs(size_bytes=4 * MiB, ttl_s=120)))
        fds: list[int] = []
        granted = read_frame(sock, max_frame_bytes=1 << 20, fds=fds)
        assert granted is not None and granted["ok"] is True and len(fds) == 1
        lease_id = granted["result"]["lease_id"]
        c.admin.revoke(lease_id, reason="drain", deadline_s=10)
        # The agent hears within a heartbeat; nothing arrives unasked for.
        ready, _, _ = select.select([sock], [], [], 3)
        assert not ready, "an event frame reached a client that never asked for one"
        sock.sendall(encode_request("renew", RenewArgs(lease_id=lease_id)))
        renewed = read_frame(sock, max_frame_bytes=1 << 20)
        assert renewed is not None and renewed["ok"] is True
        assert renewed["result"]["revoke_deadline_at"] is not None
        os.close(fds[0])


def test_a_lease_the_ledger_ends_is_lost_promptly(any_cluster: Cluster) -> None:
    """(5) `poolctl leases end`: no notice, so no on_revoke; on_lost (ended) at once."""
    c = any_cluster
    heard = Heard()
    with slow_agent(c, HOST) as sock, PoolClient(sock, timeout_s=10) as client:
        lease = lease_with(client, heard)
        ended_at = time.monotonic()
        c.admin.end_lease(lease.lease_id, reason="operator")
        assert heard.wait(heard.lost, PROMPT_S + 1), "on_lost never fired"
        at, reason = heard.lost[0]
        assert at - ended_at < PROMPT_S
        assert reason == LOST_ENDED and lease.lost
        assert not heard.revoked


def test_an_agent_killed_loses_every_lease_it_held(cluster: Cluster) -> None:
    """(6) kill -9 of the agent: the session drops, nobody answers, each lease is lost."""
    c = cluster
    heard = [Heard(), Heard()]
    with PoolClient(c.socket_path, timeout_s=5, reconnect_s=1) as client:
        leases = [lease_with(client, h) for h in heard]
        killed_at = time.monotonic()
        c.agent.kill()
        for h in heard:
            assert h.wait(h.lost, 5), "on_lost never fired"
        for h, lease in zip(heard, leases, strict=True):
            at, reason = h.lost[0]
            assert reason == LOST_CONNECTION and lease.lost
            assert at - killed_at < 1 + 3  # reconnect_s, and a try or two
        assert not client.in_session


def test_an_agent_restarted_keeps_the_leases_it_re_adopted(cluster: Cluster) -> None:
    """The agent crashes and comes back within reconnect_s: the session is opened again,
    the re-adopted lease is not lost, and its events flow on the new connection."""
    c = cluster
    heard = Heard()
    with PoolClient(c.socket_path, timeout_s=5, reconnect_s=30) as client:
        lease = lease_with(client, heard)
        c.restart_agent(kill=True)
        deadline = time.monotonic() + 30
        while not client.in_session and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.in_session and not heard.lost
        c.admin.revoke(lease.lease_id, reason="drain", deadline_s=10)
        assert heard.wait(heard.revoked, PROMPT_S + 1)
        lease.release()
        assert not heard.lost
