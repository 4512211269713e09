"""Several poold URLs: how the agent's config reads them, in which order a call tries
them, what makes it move on, and what the link keeps when an exchange fails.

Real sockets: poold's app on loopback (the ``api`` fixture) behind fault proxies
(tests/agent/faultproxy.py) that refuse, fail or swallow the requests a test picks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import AgentConfig, load, parse_poold_urls
from agent.link import PooldLink
from poold.api.client import PooldClient, failover_order
from poold.errors import LedgerUnavailable, PooldUnreachable, PoolError
from poold.procs import free_port
from poold.wire.admin import TenantSpec
from poold.wire.agent import GrantRequest, Heartbeat, LeaseOp
from tests.agent.faultproxy import Action, FaultProxy, Seen
from tests.conftest import ThreadedServer
from tests.poold.conftest import UID, device

MIB = 1 << 20


# --- the URL list -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "urls"),
    [
        ("http://a:1", ["http://a:1"]),
        ("http://a:1,http://b:2", ["http://a:1", "http://b:2"]),
        (" http://a:1 , http://b:2/ ", ["http://a:1", "http://b:2"]),
        ("http://a:1 http://b:2", ["http://a:1", "http://b:2"]),
        (["http://a:1", "http://b:2,https://c:3"], ["http://a:1", "http://b:2", "https://c:3"]),
        (["http://a:1", "http://a:1/"], ["http://a:1"]),
    ],
)
def test_poold_urls_are_split_in_order(given: str | list[str], urls: list[str]) -> None:
    assert parse_poold_urls(given) == urls


@pytest.mark.parametrize("given", ["", " , ", [], ["a:1"], "ftp://a:1", "http://"])
def test_a_bad_poold_url_fails_at_start(given: str | list[str]) -> None:
    with pytest.raises(ValueError, match="poold URL"):
        parse_poold_urls(given)


def test_the_config_takes_a_list_or_a_comma_string(tmp_path: Path) -> None:
    as_list = tmp_path / "list.toml"
    as_list.write_text('poold_url = ["http://a:1", "http://b:2"]\n')
    as_string = tmp_path / "string.toml"
    as_string.write_text('poold_url = "http://a:1,http://b:2"\n')
    assert load(as_list).poold_url == ["http://a:1", "http://b:2"]
    assert load(as_string).poold_url == ["http://a:1", "http://b:2"]
    # Flags (click's repeated --poold-url, each maybe a comma list) override the file.
    assert load(as_list, poold_url=["http://c:3,http://d:4"]).poold_url == [
        "http://c:3",
        "http://d:4",
    ]
    assert len(AgentConfig().poold_url) == 1


def test_failover_order_starts_at_the_sticky_url_and_wraps() -> None:
    assert failover_order(1, 0) == [0]
    assert failover_order(3, 0) == [0, 1, 2]
    assert failover_order(3, 1) == [1, 2, 0]
    assert failover_order(3, 2) == [2, 0, 1]


# --- the client over real sockets ---------------------------------------------------------


@pytest.fixture
def proxies(api: ThreadedServer) -> Iterator[tuple[FaultProxy, FaultProxy]]:
    with FaultProxy(api.port) as a, FaultProxy(api.port) as b:
        yield a, b


def health_calls(proxy: FaultProxy) -> int:
    return len(proxy.requests("GET", "/v1/health"))


def test_a_dead_poold_is_skipped_and_the_live_one_sticks(
    proxies: tuple[FaultProxy, FaultProxy],
) -> None:
    a, b = proxies
    with PooldClient([a.url, b.url], "x") as client:
        assert client.health()
        assert (health_calls(a), health_calls(b)) == (1, 0)
        a.stop()  # refused from now on
        assert client.health()
        assert client.base_url == b.url
        a.start()  # back, but b answered last: calls stay there
        assert client.health()
        assert (health_calls(a), health_calls(b)) == (1, 2)
        b.stop()
        assert client.health()
        assert client.base_url == a.url


def test_when_none_answers_the_next_call_starts_one_further_on() -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    with PooldClient(dead, "x") as client:
        with pytest.raises(PooldUnreachable) as err:
            client.health()
        assert all(url in err.value.message for url in dead)
        assert client.base_url == dead[1]


def test_an_http_error_is_an_answer_not_a_failover(
    proxies: tuple[FaultProxy, FaultProxy],
) -> None:
    a, b = proxies
    a.rule = lambda _seen: 500
    with PooldClient([a.url, b.url], "x") as client, pytest.raises(PoolError) as err:
        client.health()
    assert err.value.code == "internal"
    assert (health_calls(a), health_calls(b)) == (1, 0)


def test_ledger_unavailable_is_tried_once_on_the_next_poold(
    proxies: tuple[FaultProxy, FaultProxy],
) -> None:
    a, b = proxies
    a.rule = lambda _seen: 503
    with PooldClient([a.url, b.url], "x") as client:
        assert client.health()  # b's database connection works
        assert client.base_url == b.url
        b.rule = lambda _seen: 503
        with pytest.raises(LedgerUnavailable):
            client.health()
    # b, then a once: never a loop around processes sharing one database.
    assert (health_calls(a), health_calls(b)) == (2, 2)


def agent_client(api: ThreadedServer, admin: PooldClient, urls: list[str]) -> PooldClient:
    credential = admin.add_host("h1").credential
    admin.create_tenant(TenantSpec(name="t1", quota_bytes=1 << 30, allowed_uids=[UID]))
    client = PooldClient(urls, credential, timeout_s=5)
    client.register(_beat())
    return client


def _beat() -> Heartbeat:
    return Heartbeat(agent_version="test", inventory=[device()])


def test_a_lost_reply_is_resent_elsewhere_only_when_that_is_harmless(
    api: ThreadedServer, admin: PooldClient, proxies: tuple[FaultProxy, FaultProxy]
) -> None:
    a, b = proxies
    with agent_client(api, admin, [a.url, b.url]) as client:
        a.rule = lambda seen: "drop" if seen.method == "POST" else "pass"
        req = GrantRequest(
            request_id="grant-1", tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1, activate=True
        )
        lease = client.grant(req)
        # The same request, id and all, went to b after a's reply was lost.
        sent = [s.json()["request_id"] for s in (*a.seen, *b.seen) if s.path == "/v1/leases"]
        assert sent == ["grant-1", "grant-1"]
        assert client.base_url == b.url
        # An abort is not replayable: a lost reply is poold_unreachable, not a second try.
        b.rule = lambda seen: "drop" if seen.path.endswith("/abort") else "pass"
        with pytest.raises(PooldUnreachable):
            client.abort(lease.id, "test")
        assert len([s for s in (*a.seen, *b.seen) if s.path.endswith("/abort")]) == 1


# --- the link: nothing accepted is lost ----------------------------------------------------


def test_a_failed_heartbeat_keeps_its_renewals_whatever_the_status(
    api: ThreadedServer,
    admin: PooldClient,
    proxies: tuple[FaultProxy, FaultProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, _b = proxies
    with agent_client(api, admin, [a.url]) as client:
        link = PooldLink(client, "test", grant_patience_s=5)
        lease = link.grant(
            GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1, activate=True)
        )
        link.renew_later(lease.id, 600)
        statuses: Iterator[Action] = iter([500, 503, "refuse", "drop"])

        def rule(seen: Seen) -> Action:
            if seen.path == "/v1/agent/heartbeat":
                return next(statuses, "pass")
            return "pass"

        a.rule = rule
        with caplog.at_level(logging.INFO, logger="pool_agent.link"):
            for _ in range(4):
                assert link.heartbeat() is None
            assert link.heartbeat() is not None
        beats = [s.json() for s in a.requests("POST", "/v1/agent/heartbeat")]
        assert [r["lease_id"] for b in beats for r in b["renewals"]] == [lease.id] * 5
        assert admin.show_lease(lease.id).expires_at > lease.expires_at
        # One line when it started failing, one when it worked again.
        assert caplog.text.count("poold exchanges failing") == 1
        assert caplog.text.count("poold answers again") == 1


def test_a_failed_batch_is_resent_under_its_request_id(
    api: ThreadedServer, admin: PooldClient, proxies: tuple[FaultProxy, FaultProxy]
) -> None:
    a, _b = proxies
    with agent_client(api, admin, [a.url]) as client:
        link = PooldLink(client, "test")
        first = link.grant(GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1))
        second = link.grant(GrantRequest(tenant="t1", size_bytes=2 * MIB, uid=UID, pid=1))
        link.enqueue(LeaseOp(lease_id=first.id, op="abort", reason="done"))
        fates: Iterator[Action] = iter([500, "drop"])
        a.rule = lambda seen: next(fates, "pass") if seen.path == "/v1/agent/ops" else "pass"
        with pytest.raises(PoolError):
            link.flush()  # 500
        link.enqueue(LeaseOp(lease_id=second.id, op="abort", reason="done"))
        link.flush()  # dropped reply: no answer, kept
        assert link.outbox_size() == 2
        link.flush()
        assert link.outbox_size() == 0
        batches = [s.json() for s in a.requests("POST", "/v1/agent/ops")]
        ids = [b["request_id"] for b in batches]
        # The first batch three times under one id, in order, then the newer op alone.
        assert ids[0] == ids[1] == ids[2] and ids[3] != ids[0]
        assert [[o["lease_id"] for o in b["ops"]] for b in batches] == [
            [first.id],
            [first.id],
            [first.id],
            [second.id],
        ]
        assert admin.show_lease(first.id).state == "aborted"
        assert admin.show_lease(second.id).state == "aborted"
