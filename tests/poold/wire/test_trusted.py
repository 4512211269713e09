"""poold.wire.trusted: the same instance as model_construct, for every field at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import BaseModel, Field

from agent.protocol import LeaseResult
from poold.lease_states import LeaseState
from poold.wire.agent import LeaseOp
from poold.wire.common import LeaseOut
from poold.wire.delegation import LocalGrant
from poold.wire.trusted import trusted

NOW = datetime(2026, 12, 5, tzinfo=UTC)

LEASE = {
    "id": "00000000-0000-4000-8000-000000000001",
    "tenant": "t",
    "host": "h",
    "device_uid": "emu-0",
    "device_kind": "emulated",
    "media": "dram",
    "offset_bytes": 0,
    "length_bytes": 2 << 20,
    "requested_bytes": 2 << 20,
    "alignment_bytes": 2 << 20,
    "state": LeaseState.ACTIVE,
    "epoch": 7,
    "ttl_s": 60,
    "granted_at": NOW,
    "activated_at": NOW,
    "expires_at": NOW + timedelta(seconds=60),
    "ended_at": None,
    "numa_node": None,
    "local_name": "",
    "holder_uid": 1000,
    "holder_pid": 42,
    "labels": {"model": "llama"},
    "exclusive_bytes": 0,
    "replica_bytes": 0,
    "reservation_id": "r1",
}
GRANT = {
    "lease_id": LEASE["id"],
    "reservation_id": "r1",
    "tenant": "t",
    "offset_bytes": 0,
    "length_bytes": 2 << 20,
    "requested_bytes": 2 << 20,
    "epoch": 7,
    "ttl_s": 60,
    "granted_at": NOW,
    "uid": 1000,
    "gids": [1000],
    "pid": 42,
    "labels": {},
}


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        (LeaseOut, LEASE),
        (LocalGrant, GRANT),
        (
            LeaseOp,
            {
                "lease_id": LEASE["id"],
                "op": "local_grant",
                "reason": "",
                "length_bytes": None,
                "grant": LocalGrant.model_validate(GRANT),
            },
        ),
        (
            LeaseResult,
            {
                "lease_id": LEASE["id"],
                "size_bytes": 1 << 20,
                "length_bytes": 2 << 20,
                "offset_bytes": 0,
                "epoch": 7,
                "media": "dram",
                "backend": "emulated",
                "numa_node": None,
                "device_uid": "emu-0",
                "alignment_bytes": 2 << 20,
                "page_size_bytes": 4096,
                "expires_at": NOW,
                "ttl_s": 60,
                "shrinkable": False,
                "populated": False,
            },
        ),
    ],
)
def test_same_as_model_construct_and_as_validated(
    cls: type[BaseModel], values: dict[str, object]
) -> None:
    built = trusted(cls, dict(values))
    constructed = cls.model_construct(**values)
    assert built == constructed
    assert built.model_fields_set == constructed.model_fields_set == set(cls.model_fields)
    assert built.model_dump_json() == constructed.model_dump_json()
    # What it holds is what validation makes of the same values.
    assert cls.model_validate_json(built.model_dump_json()) == cls.model_validate(values)
    assert repr(built) == repr(constructed)


def test_every_field_or_none() -> None:
    missing = dict(LEASE)
    del missing["labels"]
    with pytest.raises(TypeError, match=r"missing \['labels'\]"):
        trusted(LeaseOut, missing)
    with pytest.raises(TypeError, match=r"unknown \['colour'\]"):
        trusted(LeaseOut, {**LEASE, "colour": "red"})


def test_refuses_models_it_cannot_build() -> None:
    class Aliased(BaseModel):
        name: str = Field(alias="n")

    with pytest.raises(TypeError, match="use model_construct"):
        trusted(Aliased, {"name": "x"})
