"""Shared by the agent's socket tests: a real in-test handler on the emulated backend.

It stands in for the agent service's poold link (which the service tests and the
end-to-end tests cover); sockets, fds and mmaps are all real.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.backends import Materialised
from agent.backends.emulated import EmulatedBackend
from agent.link import PooldLink
from agent.peer import Peer
from agent.protocol import (
    PROTOCOL_VERSION,
    HelloArgs,
    HelloResult,
    LeaseArgs,
    LeaseListing,
    LeaseResult,
    ListArgs,
    ListResult,
    ReleaseArgs,
    ReleaseResult,
    RenewArgs,
    RenewResult,
    ReportArgs,
    ReportResult,
    ShrinkArgs,
    ShrinkResult,
    StatsArgs,
    StatsResult,
)
from agent.server import AgentServer
from agent.service import AgentService
from agent.warm import WarmPool
from poold.api.client import PooldClient
from poold.errors import LeaseNotActive, NotOwner, NotShrinkable, UnknownLease
from poold.wire.admin import TenantSpec
from poold.wire.agent import InventoryDevice

NOBODY = 65534


class EmulatedHandler:
    """Grants every lease from the emulated backend and records what it saw."""

    def __init__(self) -> None:
        self.backend = EmulatedBackend()
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.granted: dict[str, tuple[Peer, LeaseResult, Materialised]] = {}
        self.states: dict[str, str] = {}
        self.renewals: dict[str, int] = {}
        self.releases: dict[str, int] = {}
        self.peers: list[Peer] = []
        self.disconnects: list[Peer] = []
        self.disconnected_event = threading.Event()

    def hello(self, peer: Peer, args: HelloArgs) -> HelloResult:
        self.peers.append(peer)
        return HelloResult(
            agent_version="test",
            host=socket.gethostname(),
            agent_pid=os.getpid(),
            protocol_version=PROTOCOL_VERSION,
            peer_uid=peer.uid,
            peer_gid=peer.gid,
            peer_pid=peer.pid,
            peer_gids=list(peer.gids),
        )

    def lease(self, peer: Peer, args: LeaseArgs) -> tuple[LeaseResult, int]:
        if args.labels.get("boom"):
            raise RuntimeError("handler bug")
        page_bytes = 4096
        length_bytes = -(-args.size_bytes // page_bytes) * page_bytes
        lease_id = f"lease-{next(self.ids)}"
        materialised = self.backend.materialise(length_bytes, f"poold-test-{lease_id}")
        result = LeaseResult(
            lease_id=lease_id,
            size_bytes=args.size_bytes,
            length_bytes=length_bytes,
            offset_bytes=0,
            epoch=1,
            media=args.media or "emulated",
            backend=materialised.backend,
            numa_node=materialised.numa_node,
            device_uid="emulated-0",
            alignment_bytes=page_bytes,
            page_size_bytes=materialised.page_size_bytes,
            expires_at=datetime.now(UTC) + timedelta(seconds=args.ttl_s),
            ttl_s=args.ttl_s,
        )
        with self.lock:
            self.granted[lease_id] = (peer, result, materialised)
            self.states[lease_id] = "active"
        return result, materialised.fd

    def _own(self, peer: Peer, lease_id: str) -> LeaseResult:
        if lease_id not in self.granted:
            raise UnknownLease(f"no lease {lease_id}", lease_id=lease_id)
        holder, result, _ = self.granted[lease_id]
        if holder.uid != peer.uid:
            raise NotOwner(f"lease {lease_id} is not yours")
        if self.states[lease_id] != "active":
            raise LeaseNotActive(f"lease {lease_id} is {self.states[lease_id]}")
        return result

    def renew(self, peer: Peer, args: RenewArgs) -> RenewResult:
        with self.lock:
            result = self._own(peer, args.lease_id)
            self.renewals[args.lease_id] = self.renewals.get(args.lease_id, 0) + 1
            ttl_s = args.ttl_s or result.ttl_s
            return RenewResult(
                lease_id=args.lease_id, expires_at=datetime.now(UTC) + timedelta(seconds=ttl_s)
            )

    def release(self, peer: Peer, args: ReleaseArgs) -> ReleaseResult:
        with self.lock:
            self._own(peer, args.lease_id)
            self.releases[args.lease_id] = self.releases.get(args.lease_id, 0) + 1
            self.states[args.lease_id] = "released"
            self.backend.release(self.granted[args.lease_id][2])
        return ReleaseResult(lease_id=args.lease_id, state="released")

    def shrink(self, peer: Peer, args: ShrinkArgs) -> ShrinkResult:
        with self.lock:
            self._own(peer, args.lease_id)
        raise NotShrinkable(f"lease {args.lease_id} is sealed against shrinking")

    def expire(self, lease_id: str) -> None:
        """What poold does when a ttl passes: the lease is over, renewals are refused."""
        with self.lock:
            self.states[lease_id] = "expired"
            self.backend.release(self.granted[lease_id][2])

    def list(self, peer: Peer, args: ListArgs) -> ListResult:
        with self.lock:
            return ListResult(
                leases=[
                    LeaseListing(**result.model_dump(), state=self.states[lease_id])
                    for lease_id, (holder, result, _) in self.granted.items()
                    if holder.uid == peer.uid
                ]
            )

    def stats(self, peer: Peer, args: StatsArgs) -> StatsResult:
        with self.lock:
            live = [
                result
                for lease_id, (_, result, _) in self.granted.items()
                if self.states[lease_id] == "active"
            ]
        return StatsResult(
            leases_held=len(live),
            bytes_held=sum(result.length_bytes for result in live),
            uptime_s=1.0,
            poold_reachable=True,
        )

    def report(self, peer: Peer, args: ReportArgs) -> ReportResult:
        return ReportResult(accepted=True)

    def disconnected(self, peer: Peer) -> None:
        self.disconnects.append(peer)
        self.disconnected_event.set()

    def close(self) -> None:
        with self.lock:
            for lease_id, (_, _, materialised) in self.granted.items():
                if self.states[lease_id] == "active":
                    self.backend.release(materialised)
                    self.states[lease_id] = "released"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory: sun_path holds 108 bytes, pytest's tmp_path can exceed that."""
    path = Path(tempfile.mkdtemp(prefix="poold-agent-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def handler() -> Iterator[EmulatedHandler]:
    handler = EmulatedHandler()
    yield handler
    handler.close()


@pytest.fixture
def server(sock_dir: Path, handler: EmulatedHandler) -> Iterator[AgentServer]:
    with AgentServer(sock_dir / "agent.sock", handler) as server:
        server.start_in_thread()
        yield server


def emulated_device(capacity_bytes: int, alignment_bytes: int = 2 << 20) -> InventoryDevice:
    """One emulated pool device of host h1, as an agent's inventory reports it."""
    return InventoryDevice(
        uid="h1/emulated:0",
        kind="emulated",
        media="emulated",
        capacity_bytes=capacity_bytes,
        alignment_bytes=alignment_bytes,
        health="ok",
        local_name="memfd",
    )


@dataclass
class LinkedAgent:
    """A real AgentService of host h1, linked to a real poold (the ``api`` fixture)."""

    service: AgentService
    link: PooldLink
    client: PooldClient


@contextmanager
def linked_agent(
    api_url: str,
    admin: PooldClient,
    device: InventoryDevice,
    tenants: Sequence[str],
    *,
    warm: bool = False,
) -> Iterator[LinkedAgent]:
    """Host h1 registered with ``device``, ``tenants`` allowed for this uid, an agent service
    (with a running warm pool, as the agent has, when ``warm``)."""
    credential = admin.add_host("h1").credential
    for name in tenants:
        admin.create_tenant(TenantSpec(name=name, quota_bytes=1 << 30, allowed_uids=[os.getuid()]))
    client = PooldClient(api_url, credential)
    link = PooldLink(client, "test")
    link.register([device])
    backend = EmulatedBackend()
    pool = WarmPool(backend) if warm else None
    if pool is not None:
        pool.start()
    service = AgentService("h1", link, {"emulated": backend}, pool)
    try:
        yield LinkedAgent(service, link, client)
    finally:
        service.close()
        client.close()


@contextmanager
def serving(service: AgentService) -> Iterator[Path]:
    """``service`` behind a real AgentServer socket (in a short temp dir); its path."""
    directory = Path(tempfile.mkdtemp(prefix="poold-agent-"))
    try:
        with AgentServer(directory / "agent.sock", service) as server:
            server.start_in_thread()
            yield server.socket_path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
