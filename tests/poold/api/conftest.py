"""Fixtures for API tests: a registered agent with one emulated device, and a raw client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from poold.api.client import PooldClient
from poold.wire.admin import TenantSpec
from poold.wire.agent import Heartbeat, InventoryDevice
from tests.conftest import ADMIN_TOKEN, ThreadedServer
from tests.poold.conftest import GID, UID, MiB

EMULATED = InventoryDevice(
    uid="h1/emulated:0",
    kind="emulated",
    media="emulated",
    capacity_bytes=64 * MiB,
    alignment_bytes=2 * MiB,
    health="ok",
    local_name="memfd",
)


class Agent:
    """One registered host: its credential and a client that speaks with it."""

    def __init__(self, api: ThreadedServer, admin: PooldClient, name: str, uid: str) -> None:
        self.name = name
        self.credential = admin.add_host(name).credential
        self.client = PooldClient(api.url, self.credential)
        self.device = EMULATED.model_copy(update={"uid": uid})
        self.client.register(Heartbeat(agent_version="test", inventory=[self.device]))


@pytest.fixture
def tenant(admin: PooldClient) -> str:
    admin.create_tenant(
        TenantSpec(
            name="t1",
            quota_bytes=32 * MiB,
            quota_leases=8,
            allowed_uids=[UID],
            allowed_gids=[GID],
        )
    )
    return "t1"


@pytest.fixture
def agent(api: ThreadedServer, admin: PooldClient, tenant: str) -> Iterator[Agent]:
    a = Agent(api, admin, "h1", "h1/emulated:0")
    yield a
    a.client.close()


@pytest.fixture
def other_agent(api: ThreadedServer, admin: PooldClient, agent: Agent) -> Iterator[Agent]:
    a = Agent(api, admin, "h2", "h2/emulated:0")
    yield a
    a.client.close()


class Raw:
    """Plain HTTP, for requests the typed client refuses to build."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=10)

    def request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = ADMIN_TOKEN,
        json: Any = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token is not None else {}
        if content is not None:
            headers["content-type"] = "application/json"
        return self.http.request(method, path, headers=headers, json=json, content=content)


@pytest.fixture
def raw(api: ThreadedServer) -> Iterator[Raw]:
    r = Raw(api.url)
    yield r
    r.http.close()
