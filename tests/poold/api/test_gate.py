"""Refusals are logged once per caller and code, then summarised at most once a minute: an
agent with a revoked credential retrying every heartbeat made one INFO line per request
(41 in 30 s); issue 15 asks for one line per outage. Against a real poold (HTTP on
loopback) and on `RefusalLog` with a clock of its own."""

from __future__ import annotations

import logging

import pytest

from poold.api.client import PooldClient
from poold.api.gate import RefusalLog
from poold.errors import Unauthorized, UnknownLease
from poold.wire.agent import Heartbeat
from tests.conftest import ThreadedServer


def test_a_revoked_credential_retrying_is_one_line(
    api: ThreadedServer, admin: PooldClient, caplog: pytest.LogCaptureFixture
) -> None:
    credential = admin.add_host("h1").credential
    admin.delete_host("h1")
    with (
        caplog.at_level(logging.INFO, logger="poold.api"),
        PooldClient(api.url, credential) as gone,
    ):
        for _ in range(40):
            with pytest.raises(Unauthorized):
                gone.heartbeat(Heartbeat())
        for _ in range(3):  # the administrator's refusals are each worth a line
            with pytest.raises(UnknownLease):
                admin.show_lease("no-such-lease")
        with pytest.raises(UnknownLease):
            admin.show_lease("another-lease")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused:")]
    [agent_line] = [x for x in lines if x.startswith("refused: unauthorized")]
    assert agent_line.startswith("refused: unauthorized (from 127.0.0.1): ")
    assert [x for x in lines if "unknown_lease" in x] == [
        "refused: unknown_lease (admin): no lease 'no-such-lease'",
        "refused: unknown_lease (admin): no lease 'another-lease'",
    ]


def test_repeats_are_summarised_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    refusals = RefusalLog(every_s=60, clock=lambda: now[0])
    err = Unauthorized("unknown agent credential")
    with caplog.at_level(logging.INFO, logger="poold.api"):
        for step in range(41):  # one every 0.75 s for 30 s
            now[0] = step * 0.75
            refusals.refused(err, "host h1")
        refusals.refused(UnknownLease("no lease 'x'"), "host h1")  # another code: its own line
        now[0] = 61.0
        refusals.refused(err, "host h1")  # the window closed: this one ends it, summarised
        now[0] = 200.0
        refusals.refused(err, "host h1")  # after a quiet window: a first again
        now[0] = 230.0
        refusals.refused(err, "host h1")
        refusals.refused(Unauthorized("unknown agent credential"), "host h2")
        now[0] = 300.0  # another caller's refusal flushes h1's window
        refusals.refused(err, "host h2")
    assert [r.getMessage() for r in caplog.records] == [
        "refused: unauthorized (host h1): unknown agent credential",
        "refused: unknown_lease (host h1): no lease 'x'",
        "refused: unauthorized (host h1): 41 more in the last 61s, the latest: "
        "unknown agent credential",
        "refused: unauthorized (host h1): unknown agent credential",
        "refused: unauthorized (host h2): unknown agent credential",
        "refused: unauthorized (host h1): 1 more in the last 100s, the latest: "
        "unknown agent credential",
        "refused: unauthorized (host h2): unknown agent credential",
    ]
