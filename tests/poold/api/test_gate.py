"""Refusals are logged once per caller and code, then summarised at most once a minute: an
agent with a revoked credential retrying every heartbeat made one INFO line per request
(41 in 30 s); issue 15 asks for one line per outage. Against a real poold (HTTP on
loopback); `poold.logs.RefusalLog` itself is tested in tests/poold/test_logs.py."""

from __future__ import annotations

import logging

import pytest

from poold.api.client import PooldClient
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
