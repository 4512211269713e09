"""The tenant client takes sizes as people write them: lease("64MiB"), shrink("1MiB")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.client import PoolClient
from agent.server import AgentServer
from poold.errors import InvalidSize

MIB = 1 << 20


@pytest.fixture
def client(server: AgentServer) -> Iterator[PoolClient]:
    with PoolClient(server.socket_path, timeout_s=10) as client:
        yield client


def test_lease_takes_a_size_string(client: PoolClient) -> None:
    with client.lease("3MiB") as lease:
        assert lease.size_bytes == 3 * MIB
    with client.lease("2M") as lease:
        assert lease.size_bytes == 2 * MIB


@pytest.mark.parametrize("text", ["64mb", "lots", "0.5B"])
def test_a_bad_size_string_is_invalid_size_before_sending(client: PoolClient, text: str) -> None:
    with pytest.raises(InvalidSize) as caught:
        client.lease(text)
    assert caught.value.code == "invalid_size"
    assert caught.value.detail["size"] == text
