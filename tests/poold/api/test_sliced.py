"""Does a large body validated a slice at a time (poold/api/sliced.py) give exactly what
one pydantic call gives: the same model, the same errors, the same reply JSON?"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from poold.api import sliced
from poold.wire.agent import AgentOps, Heartbeat, HeartbeatReply, RenewResult
from poold.wire.routes import heartbeat

N = 3 * sliced.SLICE + 17  # several slices and a short last one


def _renewals(n: int = N) -> list[dict[str, Any]]:
    return [{"lease_id": str(uuid.uuid4()), "ttl_s": 60} for _ in range(n)]


def _body(**fields: Any) -> bytes:
    raw = json.dumps({"agent_version": "t", "renewals": _renewals(), **fields}).encode()
    # Past the threshold, so the sliced path runs (padding in a field of the head).
    pad = max(0, sliced.SLICED_BODY_BYTES - len(raw) + 1000)
    out = json.loads(raw)
    out["agent_version"] = "t" * pad
    return json.dumps(out).encode()


def _comparable(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # An exception in ctx is another instance each time, and NaN is not equal to itself.
    return [{**e, "ctx": repr(e.get("ctx")), "input": repr(e["input"])} for e in errors]


def _one_call(model: Any, raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        return _comparable(exc.errors(include_url=False))


def _sliced(model: Any, raw: bytes) -> Any:
    try:
        return sliced.validate_json(model, raw)
    except sliced.BodyInvalid as exc:
        return _comparable(exc.errors)


def test_a_large_body_validates_to_the_model_one_call_gives() -> None:
    raw = _body(
        revoked_held=[str(uuid.uuid4()) for _ in range(N)],
        held=[str(uuid.uuid4()) for _ in range(N)],
        admission_wanted_bytes=4096,
    )
    assert len(raw) >= sliced.SLICED_BODY_BYTES
    got = sliced.validate_json(Heartbeat, raw)
    assert isinstance(got, Heartbeat)
    assert got == Heartbeat.model_validate_json(raw)
    assert got.model_fields_set == Heartbeat.model_validate_json(raw).model_fields_set
    assert (
        len(got.renewals) == N
        and got.renewals[-1].lease_id == json.loads(raw)["renewals"][-1]["lease_id"]
    )


def _bad_item(index: int, item: Any) -> bytes:
    body = json.loads(_body())
    body["renewals"][index] = item
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "raw",
    [
        _bad_item(0, {"lease_id": "", "ttl_s": 60}),  # in the first item (the head's call)
        _bad_item(2 * sliced.SLICE + 5, {"lease_id": "x", "ttl_s": 0}),  # in a later slice
        _bad_item(N - 1, {"lease_id": "x", "ttl_s": 60, "extra": 1}),  # the last slice
        _bad_item(sliced.SLICE + 1, {"lease_id": "x", "ttl_s": "sixty"}),
        _bad_item(sliced.SLICE + 2, "not an object"),
        _body(renewals=_renewals(100_001)),  # past the list's max_length
        _body(admission_wanted_bytes=-1),  # the head
        _body(unknown_field=1),
        b'{"agent_version": "t", "renewals": ['
        + b"NaN," * (sliced.SLICED_BODY_BYTES // 4)
        + b"1]}",
        b"[" + b"1," * sliced.SLICED_BODY_BYTES + b"1]",  # not an object
        b'{"renewals": [' + b" " * sliced.SLICED_BODY_BYTES,  # not JSON
    ],
    ids=[
        "first-item",
        "later-slice",
        "extra-field",
        "wrong-type",
        "not-an-object-item",
        "too-many",
        "head-field",
        "unknown-field",
        "nan",
        "list-body",
        "truncated",
    ],
)
def test_an_invalid_large_body_gets_the_errors_one_call_gives(raw: bytes) -> None:
    assert len(raw) >= sliced.SLICED_BODY_BYTES
    expected = _one_call(Heartbeat, raw)
    assert isinstance(expected, list), "the case must be invalid"
    assert _sliced(Heartbeat, raw) == expected


def test_a_model_with_validators_of_its_own_is_validated_in_one_call() -> None:
    # LeaseOp has a model validator: AgentOps' items are checked by it either way; a
    # model of its own validators (none of the routes' top models today) is not sliced.
    ops = [{"lease_id": f"L{i}", "op": "release"} for i in range(N)]
    raw = json.dumps({"ops": ops, "request_id": "r" * 40}).encode()
    raw += b" " * max(0, sliced.SLICED_BODY_BYTES - len(raw))
    assert sliced.validate_json(AgentOps, raw) == AgentOps.model_validate_json(raw)
    bad = json.loads(raw)
    bad["ops"][N - 3] = {"lease_id": "x", "op": "shrink"}  # shrink needs a length
    raw = json.dumps(bad).encode() + b" " * sliced.SLICED_BODY_BYTES
    assert _sliced(AgentOps, raw) == _one_call(AgentOps, raw)


def test_a_long_reply_renders_as_one_call_renders_it() -> None:
    adapter: TypeAdapter[Any] = TypeAdapter(heartbeat.response)
    reply = HeartbeatReply.model_validate(
        {
            "server_time": "2026-12-02T06:00:00+00:00",
            "renewed": [
                RenewResult(lease_id=str(uuid.uuid4()), code="unknown_lease", message="no lease é")
                for _ in range(N)
            ],
            "want_inventory": True,
        }
    )
    got = sliced.dump_json(adapter, reply)
    assert json.loads(got) == json.loads(adapter.dump_json(reply))
    assert HeartbeatReply.model_validate_json(got) == reply
    short = HeartbeatReply.model_validate({"server_time": "2026-12-02T06:00:00Z"})
    assert sliced.dump_json(adapter, short) == adapter.dump_json(short)
