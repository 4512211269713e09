"""What do a tenant and its host's agent say to each other over the agent's Unix socket?

Written once, imported by both :mod:`agent.server` and :mod:`agent.client` (the way
subiquity's ``apidef`` is): the frame format, the envelopes, one pydantic model per
operation's arguments and result, and the :data:`OPERATIONS` table that binds them.

Frames: a 4-byte big-endian unsigned length, then that many bytes of UTF-8 JSON holding
one object. Requests are ``{"op": name, "args": {...}}``; replies are
``{"ok": true, "result": {...}}`` or ``{"ok": false, "error": {"code", "message",
"detail"?}}`` with a stable code from :mod:`poold.errors`. A reply that carries memory
has exactly one fd attached with SCM_RIGHTS, in the same sendmsg as its frame.

A connection whose ``hello`` asked ``events`` is a tenant session: from the hello's reply
on, the agent may also send unsolicited event frames ``{"event": kind, ...}`` (one of
:data:`EVENTS`: ``revoke``, ``shrink``, ``lost``) between replies; a reply always has
``ok`` and an event never does. A connection that never asked receives none.

Requests are capped at :data:`MAX_FRAME_BYTES`: the cap protects the agent (root) from
its tenants. Replies may be larger (a ``list`` of many leases), up to
:data:`MAX_REPLY_FRAME_BYTES`, which only the client enforces.
"""

from __future__ import annotations

import array
import functools
import json
import select
import socket
import struct
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Final, Literal

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from agent import hand_off
from poold.errors import (
    AgentProtocolError,
    BadRequest,
    FrameTooLarge,
    InvalidSize,
    PoolError,
    from_wire,
)
from poold.lease_states import LeaseState
from poold.wire.common import MAX_LEASE_BYTES, MAX_TTL_S, DeviceKind, MediaClass, TenantName

# 2: hello may ask for events (tenant sessions); a version-1 agent refuses the field.
PROTOCOL_VERSION: Final = 2
MAX_FRAME_BYTES: Final = 64 * 1024
MAX_REPLY_FRAME_BYTES: Final = 16 * 1024 * 1024
# A reply carries at most one fd; room for a few more lets a reader see (and close)
# extras a confused or hostile peer attached instead of leaking them.
MAX_FDS_PER_FRAME: Final = 4
# Longest a lease request may wait for capacity (LeaseArgs.wait_s).
MAX_WAIT_S: Final = 300.0

_HEADER = struct.Struct(">I")

# --- models ---------------------------------------------------------------

LeaseId = Annotated[str, Field(min_length=1, max_length=64)]
ByteCount = Annotated[int, Field(ge=0, le=MAX_LEASE_BYTES)]
BlockCount = Annotated[int, Field(ge=0, le=1 << 48)]
LabelKey = Annotated[str, Field(min_length=1, max_length=128)]
LabelValue = Annotated[str, Field(max_length=1024)]


class Model(BaseModel):
    """Base for socket models: unknown fields are errors, so typos never pass silently."""

    model_config = ConfigDict(extra="forbid")


class HelloArgs(Model):
    """Who is calling, for the agent's logs; identity comes from SO_PEERCRED, not from here."""

    client_name: Annotated[str, Field(max_length=128)] | None = None
    client_version: Annotated[str, Field(max_length=64)] | None = None
    # Make this connection a tenant session: the agent pushes revoke/shrink/lost
    # events for the leases of this process on it (see the module docstring).
    events: bool = False

    @model_serializer(mode="wrap")
    def _without_default_events(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A plain hello stays what protocol 1 agents accept (they refuse unknown fields).
        data: dict[str, Any] = handler(self)
        if not self.events:
            data.pop("events", None)
        return data


class HelloResult(Model):
    agent_version: str
    host: str
    agent_pid: int
    protocol_version: int
    # The caller's identity as the kernel told the agent (SO_PEERCRED).
    peer_uid: int
    peer_gid: int
    peer_pid: int
    peer_gids: list[int] = Field(default_factory=list)


class LeaseArgs(Model):
    size_bytes: int = Field(gt=0, le=MAX_LEASE_BYTES)
    ttl_s: int = Field(default=60, gt=0, le=MAX_TTL_S)
    media: MediaClass | None = None
    tenant: TenantName | None = None  # None: the one tenant the caller's uid/gid may act for
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64)
    # When the pool is full: wait up to this long for capacity freed by pressure, in
    # arrival order on this agent (0: fail at once with no_capacity).
    wait_s: float = Field(default=0, ge=0, le=MAX_WAIT_S)
    # Memfd-backed leases only: leave the memfd unsealed against shrinking, so the
    # holder can give its tail back under pressure (`shrink`). A tenant that maps
    # it must then never touch past a length it shrank to (SIGBUS).
    shrinkable: bool = False
    # Pin-ready leases (memfd backends; devdax memory is always present): every page
    # allocated, zeroed and faulted in before the reply; 2 MiB pages (off | prefer, which
    # falls back to base pages | required, which fails without them; None: the agent's
    # own mode); the NUMA node the memory must be on (emulated memory is bound there, a
    # lease placed on another node's device is refused with backend_failed).
    populate: bool = False
    hugepages: Literal["off", "prefer", "required"] | None = None
    numa_node: int | None = Field(default=None, ge=0, lt=1 << 16)


class LeaseResult(Model):
    """A granted, materialised lease; the reply carries its fd."""

    lease_id: str
    size_bytes: int  # what was asked for
    length_bytes: int  # what the fd maps: size_bytes rounded up to alignment_bytes
    offset_bytes: int  # where the lease sits on its device (ledger), not an mmap offset
    epoch: int
    media: str
    backend: DeviceKind
    numa_node: int | None = None
    device_uid: str
    alignment_bytes: int
    page_size_bytes: int
    expires_at: datetime
    ttl_s: int
    # The memory can be cut down in place with `shrink` (a memfd asked shrinkable).
    shrinkable: bool = False
    # Every page was allocated and faulted in before this reply (asked `populate`, or
    # device memory): pinning it (cudaHostRegister, ibv_reg_mr) allocates nothing.
    populated: bool = False


class RenewArgs(Model):
    lease_id: LeaseId
    ttl_s: int | None = Field(default=None, gt=0, le=MAX_TTL_S)  # None: keep the lease's ttl


class RenewResult(Model):
    lease_id: str
    expires_at: datetime
    # Set when poold revoked the lease: the memory goes away at this time
    # (devdax: the sub-device is destroyed and the mapping SIGBUSes).
    revoke_deadline_at: datetime | None = None
    # Pool pressure (poold's shrink hint): give this many bytes of the lease back by
    # the deadline, replicas first. Each hint is handed out once; None: nothing asked.
    shrink_target_bytes: int | None = Field(default=None, gt=0)
    shrink_deadline_at: datetime | None = None


class ReleaseArgs(Model):
    lease_id: LeaseId


class ReleaseResult(Model):
    lease_id: str
    state: LeaseState


class ShrinkArgs(Model):
    """Give back the tail of a shrinkable lease: it keeps ``size_bytes`` (rounded up to
    its alignment); the bytes past that are gone from every mapping."""

    lease_id: LeaseId
    size_bytes: int = Field(gt=0, le=MAX_LEASE_BYTES)


class ShrinkResult(Model):
    lease_id: str
    length_bytes: int  # the lease's new length
    freed_bytes: int


class ListArgs(Model):
    pass


class LeaseListing(LeaseResult):
    state: LeaseState
    # Revoked: the memory goes at this time (what a session that reconnects missed).
    revoke_deadline_at: datetime | None = None


class ListResult(Model):
    leases: list[LeaseListing]


class StatsArgs(Model):
    pass


class StatsResult(Model):
    """Leases and bytes held: host-wide for root, the caller's own uid's for anyone else
    (``scope``), so a socket user learns nothing of other tenants."""

    scope: Literal["host", "caller"] = "host"
    leases_held: int
    bytes_held: int
    # Revoked memfd leases whose holder still maps them (counted apart from bytes_held).
    revoked_held_leases: int = 0
    revoked_held_bytes: int = 0
    uptime_s: float
    poold_reachable: bool
    last_heartbeat_at: datetime | None = None


class ReportArgs(Model):
    """Exclusive/replica accounting for one lease (DESIGN.md "Exclusive-copy accounting")."""

    lease_id: LeaseId
    used_bytes: ByteCount
    exclusive_bytes: ByteCount
    replica_bytes: ByteCount
    exclusive_blocks: BlockCount = 0
    replica_blocks: BlockCount = 0

    @model_validator(mode="after")
    def _copies_fit_in_use(self) -> ReportArgs:
        # A block is either the only copy or a replica, and either way it is in use.
        if self.exclusive_bytes + self.replica_bytes > self.used_bytes:
            raise ValueError("exclusive_bytes + replica_bytes exceeds used_bytes")
        return self


class ReportResult(Model):
    accepted: bool


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One operation: its argument and result models, and whether replies carry an fd."""

    name: str
    args_model: type[Model]
    result_model: type[Model]
    carries_fd: bool = False


OPERATIONS: Final[dict[str, OpSpec]] = {
    spec.name: spec
    for spec in (
        OpSpec("hello", HelloArgs, HelloResult),
        OpSpec("lease", LeaseArgs, LeaseResult, carries_fd=True),
        OpSpec("renew", RenewArgs, RenewResult),
        OpSpec("release", ReleaseArgs, ReleaseResult),
        OpSpec("shrink", ShrinkArgs, ShrinkResult),
        OpSpec("list", ListArgs, ListResult),
        OpSpec("stats", StatsArgs, StatsResult),
        OpSpec("report", ReportArgs, ReportResult),
    )
}

# --- events (agent -> tenant session) --------------------------------------------------


class RevokeEvent(Model):
    """poold revoked the lease: stop using it; its memory goes at ``deadline_at``."""

    event: Literal["revoke"] = "revoke"
    lease_id: str
    deadline_at: datetime


class ShrinkEvent(Model):
    """Pool pressure: give ``target_bytes`` of the lease back by ``deadline_at``;
    ``replica_bytes`` of them can come from replicas (the rest would be only copies)."""

    event: Literal["shrink"] = "shrink"
    lease_id: str
    target_bytes: int = Field(gt=0)
    replica_bytes: int = Field(default=0, ge=0)
    deadline_at: datetime


# Why a lease is gone (LostEvent.reason; the client adds its own, see agent/client.py).
LOST_REVOKED: Final = "revoked"  # its revocation deadline passed: the agent took it back
LOST_ENDED: Final = "ended"  # the ledger ended it without notice (admin end, expiry, reclaim)


class LostEvent(Model):
    """The lease is over: its memory is gone (devdax) or no longer the tenant's (memfd)."""

    event: Literal["lost"] = "lost"
    lease_id: str
    reason: Annotated[str, Field(max_length=64)]  # LOST_*; others may come from newer agents
    message: Annotated[str, Field(max_length=512)] = ""


Event = RevokeEvent | ShrinkEvent | LostEvent
EVENTS: Final[dict[str, type[Model]]] = {
    "revoke": RevokeEvent,
    "shrink": ShrinkEvent,
    "lost": LostEvent,
}
# Events a session's queue never drops (agent/server.py): losing one loses a warning.
CRITICAL_EVENTS: Final = frozenset({"revoke", "lost"})


def encode_event(event: Event) -> bytes:
    """The frame of one event."""
    return _frame(pydantic_core.to_json(event))


def is_event(frame: dict[str, Any]) -> bool:
    """An unsolicited event frame, not a reply (replies always have ``ok``)."""
    return "event" in frame and "ok" not in frame


def parse_event(frame: dict[str, Any]) -> Event | None:
    """The validated event; None for a kind this client does not know (a newer agent's).

    A known kind that does not validate raises AgentProtocolError.
    """
    model = EVENTS.get(str(frame.get("event")))
    if model is None:
        return None
    try:
        event = model.model_validate(frame)
    except ValidationError as err:
        raise AgentProtocolError(f"{frame.get('event')!r} event does not validate: {err}") from None
    if not isinstance(event, RevokeEvent | ShrinkEvent | LostEvent):  # pragma: no cover
        raise AgentProtocolError(f"{frame.get('event')!r} is not an event")
    return event


# --- frames ---------------------------------------------------------------


def encode_frame(obj: BaseModel | dict[str, Any]) -> bytes:
    """Length prefix plus compact JSON; raises FrameTooLarge past MAX_REPLY_FRAME_BYTES."""
    if isinstance(obj, BaseModel):
        body = pydantic_core.to_json(obj)
    else:
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    return _frame(body)


def _frame(body: bytes) -> bytes:
    if len(body) > MAX_REPLY_FRAME_BYTES:
        raise FrameTooLarge(
            f"frame of {len(body)} bytes exceeds {MAX_REPLY_FRAME_BYTES}", size_bytes=len(body)
        )
    return _HEADER.pack(len(body)) + body


def _until(sock: socket.socket, deadline: float | None) -> None:
    """Bound the next blocking call by ``deadline`` (monotonic); TimeoutError once past it."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("frame deadline passed")
    sock.settimeout(left)


def _recv_exact(
    sock: socket.socket, length: int, fds: list[int] | None, deadline: float | None = None
) -> bytes:
    """Exactly ``length`` bytes; b"" on EOF before the first byte; BadRequest on EOF after it.

    With ``fds`` given, any SCM_RIGHTS fds riding on the bytes are appended to it (the
    kernel attaches them to the first byte of the sender's sendmsg, so they may arrive
    with any chunk); without it, the kernel closes any fds a peer sent. With
    ``deadline`` (monotonic), the bytes must all arrive by then, however slowly they
    trickle: TimeoutError otherwise.
    """
    if fds is None:
        chunks: list[bytes] = []
        remaining = length
        # What has arrived is taken without waiting first: on a socket without a timeout
        # that is one recv, where a timeout makes it a settimeout (an ioctl), a poll and
        # a recv, each a point where the GIL passes to another thread (the agent's
        # socket threads spent a third of their CPU handing it over). Only a frame that
        # is not all there yet waits, bounded by the deadline; every read after the first
        # checks it, so a peer that trickles bytes just in time is still cut off
        # (tests/security/test_socket_abuse.py).
        try:
            chunk = sock.recv(remaining, socket.MSG_DONTWAIT)
        except BlockingIOError:
            chunk = None
        if chunk is not None:
            if chunk:
                chunks.append(chunk)
                remaining -= len(chunk)
            else:
                remaining = 0  # EOF
        while remaining:
            hand_off.ahead()  # the agent's socket loop goes on while this frame trickles
            _until(sock, deadline)
            chunk = sock.recv(remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
    else:
        data = _recvmsg_exact(sock, length, fds, deadline)
    if data and len(data) < length:
        raise BadRequest(f"connection closed mid-frame ({len(data)} of {length} bytes)")
    return data


_ANC_SIZE: Final = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * array.array("i").itemsize)
# The socket module's flags are enum members, whose ``|`` costs more than the syscall.
_RECV_NOW: Final = int(socket.MSG_CMSG_CLOEXEC) | int(socket.MSG_DONTWAIT)
_CTRUNC: Final = int(socket.MSG_CTRUNC)


def _wait_readable(sock: socket.socket, deadline: float | None) -> None:
    """Until ``sock`` has bytes (or EOF) to read; TimeoutError once ``deadline`` passes.
    Polls the fd itself: the socket's timeout, and the fd's O_NONBLOCK flag that a dup
    shares with the socket it was made from, are left as they are."""
    timeout_ms: float | None = None
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("frame deadline passed")
        timeout_ms = left * 1000
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    if not poller.poll(timeout_ms):
        raise TimeoutError("frame deadline passed")


def _recvmsg_exact(
    sock: socket.socket, length: int, fds: list[int], deadline: float | None
) -> bytes:
    chunks: list[bytes] = []
    remaining = length
    # A socket without a timeout (a session's reader, on a dup of the client's socket):
    # what has arrived is taken at once, as _recv_exact does, where a timeout would cost
    # an ioctl and a poll before every recvmsg; only a frame not all there yet is waited
    # for, by polling the fd (setting a timeout here would switch O_NONBLOCK on the file
    # the client's own socket shares).
    at_once = sock.gettimeout() is None
    while remaining:
        if at_once:
            try:
                chunk, ancdata, flags, _ = sock.recvmsg(remaining, _ANC_SIZE, _RECV_NOW)
            except BlockingIOError:
                _wait_readable(sock, deadline)
                continue
        else:
            _until(sock, deadline)
            chunk, ancdata, flags, _ = sock.recvmsg(remaining, _ANC_SIZE, socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                fds.extend(received)
        if flags & _CTRUNC:
            raise BadRequest("peer attached more file descriptors than a frame may carry")
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(
    sock: socket.socket,
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    fds: list[int] | None = None,
    deadline: float | None = None,
) -> dict[str, Any] | None:
    """Read exactly one frame; None on a clean EOF before it.

    Raises FrameTooLarge when the announced length exceeds ``max_frame_bytes`` (the body
    is left unread: the caller must close the connection) and BadRequest when the body
    is not a UTF-8 JSON object or the connection ends mid-frame. Socket errors
    (OSError, TimeoutError) propagate; TimeoutError too when the whole frame has not
    arrived by ``deadline`` (monotonic; the agent's cap on a peer that trickles a
    frame). Received fds are appended to ``fds``; the caller owns them even when this
    raises.
    """
    header = _recv_exact(sock, _HEADER.size, fds, deadline)
    if not header:
        return None
    (length,) = _HEADER.unpack(header)
    if length > max_frame_bytes:
        raise FrameTooLarge(
            f"frame of {length} bytes exceeds the {max_frame_bytes}-byte cap",
            size_bytes=length,
            max_bytes=max_frame_bytes,
        )
    body = _recv_exact(sock, length, fds, deadline) if length else b""
    if len(body) < length:
        raise BadRequest("connection closed after a frame header")
    try:
        # pydantic's parser (jiter): UTF-8 only, no lone surrogates, nesting bounded, and
        # a few times faster than json.loads on a request's frame.
        obj = pydantic_core.from_json(body)
    except ValueError as err:
        raise BadRequest(f"frame is not valid UTF-8 JSON: {err}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"frame must hold a JSON object, got {type(obj).__name__}")
    return obj


# --- envelopes ------------------------------------------------------------

_OK_PREFIX = b'{"ok":true,"result":'


@functools.cache
def _request_prefix(op: str) -> bytes:
    return b'{"op":' + json.dumps(op).encode() + b',"args":'


def encode_request(op: str, args: BaseModel) -> bytes:
    """The frame for one request."""
    return _frame(_request_prefix(op) + pydantic_core.to_json(args) + b"}")


def encode_result(result: BaseModel) -> bytes:
    """The frame for a successful reply, serialised straight from the result model."""
    return _frame(_OK_PREFIX + pydantic_core.to_json(result) + b"}")


def encode_error(err: PoolError) -> bytes:
    """The frame for an error reply; detail that JSON cannot hold is dropped, not fatal."""
    try:
        return encode_frame({"ok": False, "error": err.to_dict()})
    except (TypeError, ValueError):
        return encode_frame({"ok": False, "error": {"code": err.code, "message": err.message}})


def validation_error(err: ValidationError, what: str) -> BadRequest:
    """A wire error for a pydantic failure: invalid_size when the size is what's wrong."""
    problems = err.errors(include_url=False, include_context=False, include_input=False)
    summary = "; ".join(
        f"{'.'.join(str(part) for part in problem['loc']) or what}: {problem['msg']}"
        for problem in problems[:5]
    )
    cls = (
        InvalidSize
        if any(problem["loc"][:1] == ("size_bytes",) for problem in problems)
        else BadRequest
    )
    return cls(f"invalid {what}: {summary}", errors=problems)


def parse_request(frame: dict[str, Any]) -> tuple[OpSpec, Model]:
    """The operation and its validated arguments; BadRequest / InvalidSize otherwise."""
    op = frame.get("op")
    spec = OPERATIONS.get(op) if isinstance(op, str) else None
    if spec is None:
        raise BadRequest(
            f"unknown operation {op!r}; known: {', '.join(OPERATIONS)}", op=str(op)[:64]
        )
    extra = frame.keys() - {"op", "args"}
    if extra:
        raise BadRequest(f"unexpected request fields: {', '.join(sorted(extra))[:200]}")
    args = frame.get("args", {})
    if not isinstance(args, dict):
        raise BadRequest(f"args of {spec.name!r} must be an object")
    try:
        return spec, spec.args_model.model_validate(args)
    except ValidationError as err:
        raise validation_error(err, f"{spec.name} arguments") from None


def parse_reply(spec: OpSpec, frame: dict[str, Any]) -> Model:
    """The validated result of a reply; raises the agent's error, rebuilt with its code.

    A reply that breaks the protocol raises AgentProtocolError: that is the agent's
    fault (or a version skew), never the tenant's bad request.
    """
    if frame.get("ok") is True:
        result = frame.get("result")
        if not isinstance(result, dict):
            raise AgentProtocolError(f"reply to {spec.name!r} has no result object")
        try:
            return spec.result_model.model_validate(result)
        except ValidationError as err:
            raise AgentProtocolError(f"reply to {spec.name!r} does not validate: {err}") from None
    error = frame.get("error")
    if frame.get("ok") is not False or not isinstance(error, dict):
        raise AgentProtocolError(f"reply to {spec.name!r} is neither a result nor an error")
    code = str(error.get("code", "internal"))
    message = str(error.get("message", ""))
    detail = error.get("detail")
    try:
        raise from_wire(code, message, detail if isinstance(detail, dict) else None)
    except TypeError:  # detail keys that clash with the exception's own parameters
        raise from_wire(code, message) from None
