"""agent.protocol: frames over real socketpairs, envelopes, the operations table."""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.protocol import (
    CRITICAL_EVENTS,
    EVENTS,
    LOST_REVOKED,
    MAX_FRAME_BYTES,
    OPERATIONS,
    Event,
    HelloArgs,
    LeaseArgs,
    LostEvent,
    RenewResult,
    ReportArgs,
    RevokeEvent,
    ShrinkEvent,
    encode_error,
    encode_event,
    encode_frame,
    encode_request,
    encode_result,
    is_event,
    parse_event,
    parse_reply,
    parse_request,
    read_frame,
)
from poold.errors import (
    AgentProtocolError,
    BadRequest,
    FrameTooLarge,
    InvalidSize,
    PoolError,
    QuotaExceeded,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left.settimeout(5)
    right.settimeout(5)
    with left, right:
        yield left, right


def test_frame_round_trip(pair: tuple[socket.socket, socket.socket]) -> None:
    writer, reader = pair
    writer.sendall(encode_frame({"op": "hello", "args": {"client_name": "vllm ✓"}}))
    writer.sendall(encode_frame(HelloArgs(client_name="sglang")))
    assert read_frame(reader) == {"op": "hello", "args": {"client_name": "vllm ✓"}}
    assert read_frame(reader) == {"client_name": "sglang", "client_version": None}


def test_frame_is_big_endian_length_then_json() -> None:
    assert encode_frame({"a": 1}) == b'\x00\x00\x00\x07{"a":1}'


def test_clean_eof_before_a_frame_is_none(pair: tuple[socket.socket, socket.socket]) -> None:
    writer, reader = pair
    writer.shutdown(socket.SHUT_WR)
    assert read_frame(reader) is None


@pytest.mark.parametrize("partial", [b"\x00\x00", b'\x00\x00\x00\x10{"op"'])
def test_eof_mid_frame_is_bad_request(
    pair: tuple[socket.socket, socket.socket], partial: bytes
) -> None:
    writer, reader = pair
    writer.sendall(partial)
    writer.shutdown(socket.SHUT_WR)
    with pytest.raises(BadRequest, match=r"mid-frame|after a frame header"):
        read_frame(reader)


def test_oversized_frame_raises_before_reading_the_body(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    writer, reader = pair
    writer.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"body")
    with pytest.raises(FrameTooLarge) as caught:
        read_frame(reader)
    assert caught.value.code == "frame_too_large"
    assert reader.recv(16) == b"body"  # left in the socket for the caller to drop


def test_frame_at_the_cap_is_accepted(pair: tuple[socket.socket, socket.socket]) -> None:
    writer, reader = pair
    filler = "x" * (MAX_FRAME_BYTES - len('{"pad":""}'))
    frame = encode_frame({"pad": filler})
    assert len(frame) == 4 + MAX_FRAME_BYTES
    sender = _send_in_background(writer, frame)
    assert read_frame(reader) == {"pad": filler}
    sender.join()


def _send_in_background(sock: socket.socket, data: bytes) -> Any:
    import threading

    thread = threading.Thread(target=sock.sendall, args=(data,))
    thread.start()
    return thread


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b"1",
        b"null",
        b"{bad",
        b"\xc3\x28",
        b'{"a":NaN',
        b'{"a":"\\ud800"}',  # a lone surrogate escape
        b'{"a":' + b"[" * 10_000 + b"]" * 10_000 + b"}",  # nesting past the parser's bound
        b'\xff\xfe{\x00"\x00a\x00"\x00:\x001\x00}\x00',  # UTF-16, which json.loads on bytes took
        b'{"a":1} trailing',
    ],
)
def test_body_must_be_a_json_object(pair: tuple[socket.socket, socket.socket], body: bytes) -> None:
    writer, reader = pair
    writer.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(BadRequest):
        read_frame(reader)


def test_fds_ride_with_the_frame(pair: tuple[socket.socket, socket.socket]) -> None:
    writer, reader = pair
    read_end, write_end = os.pipe()
    try:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [write_end]))]
        writer.sendmsg([encode_frame({"ok": True})], rights)
        fds: list[int] = []
        assert read_frame(reader, fds=fds) == {"ok": True}
        assert len(fds) == 1
        os.write(fds[0], b"!")
        os.close(fds[0])
        assert os.read(read_end, 1) == b"!"
    finally:
        os.close(read_end)
        os.close(write_end)


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=2048)
    | st.builds(
        lambda length, body: struct.pack(">I", length) + body,
        st.integers(min_value=0, max_value=(1 << 32) - 1),
        st.binary(max_size=512),
    )
)
def test_random_bytes_never_crash_the_reader(data: bytes) -> None:
    writer, reader = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with writer, reader:
        reader.settimeout(5)
        writer.sendall(data)
        writer.shutdown(socket.SHUT_WR)
        outcome = _read_until_done(reader, limit=len(data) + 1)
    assert outcome is None or outcome.code in ("bad_request", "frame_too_large")


def _read_until_done(reader: socket.socket, limit: int) -> PoolError | None:
    """Read frames until EOF (None) or the first error, which is returned, not raised."""
    for _ in range(limit):
        try:
            frame = read_frame(reader)
        except PoolError as err:
            return err
        if frame is None:
            return None
        assert isinstance(frame, dict)
    raise AssertionError("more frames than bytes")


# --- envelopes ---------------------------------------------------------------------


def test_a_session_reader_waits_without_touching_the_shared_file() -> None:
    """A tenant session reads on a dup of the client's socket (agent/session.py): the dup
    shares the open file, whose O_NONBLOCK the client's timeout relies on. A frame that
    arrives in pieces is waited for, its fds kept, and the file's flags left alone."""
    client, agent = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with client, agent:
        client.settimeout(5)
        reader = socket.socket(fileno=os.dup(client.fileno()))
        with reader:
            assert reader.gettimeout() is None
            frame = encode_frame({"ok": True, "result": {"n": 1}})
            fd = os.memfd_create("t", os.MFD_CLOEXEC)
            try:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                agent.sendmsg([frame[:6]], rights)
                timer = threading.Timer(0.2, agent.sendall, args=(frame[6:],))
                timer.start()
                fds: list[int] = []
                got = read_frame(reader, fds=fds, deadline=time.monotonic() + 5)
                timer.join()
            finally:
                os.close(fd)
            assert got == {"ok": True, "result": {"n": 1}}
            assert len(fds) == 1
            os.close(fds[0])
            assert reader.gettimeout() is None
            assert os.get_blocking(client.fileno()) is False  # the client's timeout holds
            # A frame begun and not finished by the deadline is a timeout, as before.
            agent.sendall(frame[:6])
            with pytest.raises(TimeoutError):
                read_frame(reader, fds=[], deadline=time.monotonic() + 0.2)
            assert os.get_blocking(client.fileno()) is False


def test_request_round_trip() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(
            encode_request("lease", LeaseArgs(size_bytes=1 << 21, labels={"model": "llama"}))
        )
        spec, args = parse_request(read_frame(right) or {})
    assert spec.name == "lease"
    assert spec.carries_fd
    assert args == LeaseArgs(size_bytes=1 << 21, labels={"model": "llama"})


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        ({"op": "nope"}, BadRequest),
        ({"op": None}, BadRequest),
        ({"op": "hello", "args": "x"}, BadRequest),
        ({"op": "hello", "extra": 1}, BadRequest),
        ({"op": "lease", "args": {"size_bytes": 0}}, InvalidSize),
        ({"op": "lease", "args": {"size_bytes": (1 << 50) + 1}}, InvalidSize),
        ({"op": "lease", "args": {"size_bytes": 1, "media": "NVMe!"}}, BadRequest),
        ({"op": "lease", "args": {"size_bytes": 1, "labels": {"k": 1}}}, BadRequest),
    ],
)
def test_parse_request_rejects(frame: dict[str, Any], error: type[PoolError]) -> None:
    with pytest.raises(error) as caught:
        parse_request(frame)
    assert type(caught.value) is error


def test_args_default_to_empty() -> None:
    spec, args = parse_request({"op": "stats"})
    assert spec.name == "stats"
    assert args.model_dump() == {}


def test_lease_defaults() -> None:
    args = LeaseArgs(size_bytes=4096)
    assert (args.ttl_s, args.media, args.tenant, args.labels) == (60, None, None, {})


def test_report_copies_must_fit_in_use() -> None:
    ReportArgs(lease_id="l", used_bytes=10, exclusive_bytes=6, replica_bytes=4)
    with pytest.raises(ValueError, match="exceeds used_bytes"):
        ReportArgs(lease_id="l", used_bytes=10, exclusive_bytes=6, replica_bytes=5)


def test_result_and_error_round_trip() -> None:
    expires_at = datetime(2030, 1, 1, tzinfo=UTC)
    frame = encode_result(RenewResult(lease_id="l-1", expires_at=expires_at))
    left, right = socket.socketpair()
    with left, right:
        left.sendall(frame)
        left.sendall(encode_error(QuotaExceeded("tenant a is at its quota", quota_bytes=1 << 30)))
        assert parse_reply(OPERATIONS["renew"], read_frame(right) or {}) == RenewResult(
            lease_id="l-1", expires_at=expires_at
        )
        with pytest.raises(QuotaExceeded) as caught:
            parse_reply(OPERATIONS["renew"], read_frame(right) or {})
    assert caught.value.code == "quota_exceeded"
    assert caught.value.detail == {"quota_bytes": 1 << 30}


def test_unknown_error_codes_stay_visible() -> None:
    with pytest.raises(PoolError) as caught:
        parse_reply(
            OPERATIONS["hello"], {"ok": False, "error": {"code": "future_code", "message": "m"}}
        )
    assert caught.value.code == "future_code"


def test_error_detail_clashing_with_parameters_is_dropped() -> None:
    reply = {
        "ok": False,
        "error": {"code": "not_owner", "message": "m", "detail": {"message": "x"}},
    }
    with pytest.raises(PoolError) as caught:
        parse_reply(OPERATIONS["hello"], reply)
    assert caught.value.code == "not_owner"


@pytest.mark.parametrize(
    "frame",
    [{}, {"ok": True}, {"ok": True, "result": {"lease_id": "x"}}, {"ok": False}, {"ok": "yes"}],
)
def test_malformed_replies_are_protocol_errors(frame: dict[str, Any]) -> None:
    with pytest.raises(AgentProtocolError):
        parse_reply(OPERATIONS["renew"], frame)


def test_error_detail_that_json_cannot_hold_is_dropped() -> None:
    frame = encode_error(BadRequest("bad", thing=object()))
    assert frame.endswith(b'{"ok":false,"error":{"code":"bad_request","message":"bad"}}')


def test_operations_table_matches_the_design() -> None:
    # DESIGN.md's operations, plus shrink (pressure: give a memfd lease's tail back).
    assert set(OPERATIONS) == {
        "hello",
        "lease",
        "renew",
        "release",
        "list",
        "stats",
        "report",
        "shrink",
    }
    assert [name for name, spec in OPERATIONS.items() if spec.carries_fd] == ["lease"]
    for name, spec in OPERATIONS.items():
        assert spec.name == name
        assert spec.args_model.model_config.get("extra") == "forbid"
        assert spec.result_model.model_config.get("extra") == "forbid"


# --- events ---------------------------------------------------------------------------


def test_a_plain_hello_is_what_protocol_1_agents_accept() -> None:
    # Version-1 agents refuse unknown fields: `events` is sent only when asked for.
    plain = json.loads(encode_request("hello", HelloArgs(client_name="x"))[4:])
    assert plain == {"op": "hello", "args": {"client_name": "x", "client_version": None}}
    asked = json.loads(encode_request("hello", HelloArgs(events=True))[4:])
    assert asked["args"]["events"] is True
    _, args = parse_request(asked)
    assert isinstance(args, HelloArgs) and args.events


def test_events_round_trip_and_never_look_like_replies(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    at = datetime(2026, 1, 1, tzinfo=UTC)
    sent: list[Event] = [
        RevokeEvent(lease_id="a", deadline_at=at),
        ShrinkEvent(lease_id="a", target_bytes=1 << 20, replica_bytes=1 << 19, deadline_at=at),
        LostEvent(lease_id="a", reason=LOST_REVOKED, message="gone"),
    ]
    for event in sent:
        left.sendall(encode_event(event))
    for event in sent:
        frame = read_frame(right)
        assert frame is not None and is_event(frame)
        assert parse_event(frame) == event
    assert set(EVENTS) == {"revoke", "shrink", "lost"} and set(EVENTS) > CRITICAL_EVENTS
    assert not is_event(json.loads(encode_result(RenewResult(lease_id="a", expires_at=at))[4:]))


def test_an_unknown_event_kind_is_skipped_and_a_bad_one_refused() -> None:
    assert parse_event({"event": "teleport", "lease_id": "a"}) is None
    with pytest.raises(AgentProtocolError):
        parse_event({"event": "revoke", "lease_id": "a"})  # no deadline
