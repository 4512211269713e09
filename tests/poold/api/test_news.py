"""The agent's long poll (`POST /v1/agent/news`): news of a host reaches its waiting
agent within a round trip of the ledger deciding it, on either backend and from
another poold process on the same PostgreSQL; nothing else wakes it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from poold.api.client import PooldClient
from poold.errors import Forbidden
from poold.ledger.db import Ledger
from poold.ledger.news import HostNews
from poold.wire.agent import GrantRequest, LeaseOp, News
from tests.conftest import ADMIN_TOKEN, ThreadedServer
from tests.poold.api.conftest import Agent
from tests.poold.conftest import GID, UID, MiB

GRANT = GrantRequest(tenant="t1", size_bytes=2 * MiB, uid=UID, gids=[GID], pid=4242, activate=True)


class Waiter:
    """One wait for news in a thread: when it answered, and what."""

    def __init__(self, client: PooldClient, token: str, timeout_s: float) -> None:
        self.answer: News | None = None
        self.at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(client, token, timeout_s))
        self.thread.start()
        time.sleep(0.3)  # the request is in poold and waiting

    def _run(self, client: PooldClient, token: str, timeout_s: float) -> None:
        self.answer = client.wait_news(token, timeout_s=timeout_s)
        self.at = time.monotonic()

    def result(self) -> tuple[News, float]:
        self.thread.join(timeout=30)
        assert self.answer is not None and self.at is not None
        return self.answer, self.at


def settled_token(client: PooldClient) -> str:
    """A token with nothing pending: the first wait answers at once (news=True), and
    so may one as the PostgreSQL listener connects (it wakes every waiter then)."""
    first = client.wait_news(None, timeout_s=5)
    assert first.news
    token = first.token
    while (again := client.wait_news(token, timeout_s=0.5)).news:
        token = again.token
    return token


def test_a_revocation_wakes_the_hosts_agent_at_once(agent: Agent, admin: PooldClient) -> None:
    lease = agent.client.grant(GRANT)
    token = settled_token(agent.client)
    waiter = Waiter(agent.client, token, timeout_s=20)
    revoked_at = time.monotonic()
    admin.revoke(lease.id, "test", deadline_s=30)
    news, at = waiter.result()
    assert news.news and news.token != token
    assert at - revoked_at < 2.0  # not the 20 s timeout, nor a heartbeat interval


def test_nothing_new_times_out_and_the_agents_own_acts_are_not_news(agent: Agent) -> None:
    token = settled_token(agent.client)
    waiter = Waiter(agent.client, token, timeout_s=1.5)
    lease = agent.client.grant(GRANT)  # the agent's own grant and release: it knows
    agent.client.apply_ops([LeaseOp(lease_id=lease.id, op="release")])
    news, _ = waiter.result()
    assert not news.news and news.token == token


def test_another_hosts_news_does_not_wake_it(
    agent: Agent, other_agent: Agent, admin: PooldClient
) -> None:
    lease = agent.client.grant(GRANT)
    token = settled_token(other_agent.client)
    waiter = Waiter(other_agent.client, token, timeout_s=1.5)
    admin.revoke(lease.id, "test", deadline_s=30)
    news, _ = waiter.result()
    assert not news.news


def test_a_stale_or_foreign_token_answers_at_once(agent: Agent) -> None:
    started = time.monotonic()
    news = agent.client.wait_news("another-poold:7", timeout_s=10)
    assert news.news and time.monotonic() - started < 2


@pytest.fixture
def second_poold(ledger_url: str, api: ThreadedServer) -> Iterator[ThreadedServer]:
    """Another poold process's worth of state (its own Ledger and app) on the same ledger."""
    other = Ledger(ledger_url)
    try:
        with ThreadedServer(other) as server:
            yield server
    finally:
        other.dispose()


@pytest.mark.postgres
def test_news_made_by_one_poold_wakes_an_agent_waiting_on_another(
    ledger_url: str, agent: Agent, admin: PooldClient, second_poold: ThreadedServer
) -> None:
    if not ledger_url.startswith("postgresql"):
        pytest.skip("several poolds share a PostgreSQL ledger")
    lease = agent.client.grant(GRANT)
    with PooldClient(second_poold.url, agent.credential) as there:
        token = settled_token(there)
        waiter = Waiter(there, token, timeout_s=20)
        revoked_at = time.monotonic()
        admin.revoke(lease.id, "test", deadline_s=30)  # through the first poold
        news, at = waiter.result()
    assert news.news
    assert at - revoked_at < 2.0


def test_host_news_counts_and_times_out() -> None:
    hub = HostNews()

    async def scenario() -> None:
        woke, token = await hub.wait(1, None, 5)
        assert woke  # a first wait looks at once
        woke, same = await hub.wait(1, token, 0.05)
        assert not woke and same == token
        waiting = asyncio.ensure_future(hub.wait(1, token, 5))
        await asyncio.sleep(0.05)
        threading.Thread(target=hub.signal, args=([2, 1],)).start()
        woke, newer = await asyncio.wait_for(waiting, 2)
        assert woke and newer != token
        woke, _ = await hub.wait(2, hub.token(2), 0.05)
        assert not woke

    asyncio.run(scenario())


def test_the_admin_token_cannot_wait(api: ThreadedServer) -> None:
    with (
        PooldClient(api.url, ADMIN_TOKEN) as admin_client,
        pytest.raises(Forbidden),
    ):
        admin_client.wait_news(None, timeout_s=1)
