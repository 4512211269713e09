"""What must an object implement to serve the agent protocol?

:class:`AgentHandler`: one method per operation in :data:`agent.protocol.OPERATIONS`
plus ``disconnected``; :func:`bind_handler` checks a handler against it when the
server is built, so a missing method fails at start, not at the first request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from agent.peer import Peer
from agent.protocol import (
    OPERATIONS,
    HelloArgs,
    HelloResult,
    LeaseArgs,
    LeaseResult,
    ListArgs,
    ListResult,
    Model,
    ReleaseArgs,
    ReleaseResult,
    RenewArgs,
    RenewResult,
    ReportArgs,
    ReportResult,
    ShrinkArgs,
    ShrinkResult,
    StatsArgs,
    StatsResult,
)


class AgentHandler(Protocol):
    """What the server calls: one method per operation, plus the end of a connection.

    Methods run on the connection's thread and may block. They raise
    :class:`poold.errors.PoolError` subclasses for failures the tenant can act on;
    anything else is logged and reported as ``internal``. ``lease`` returns the fd to
    pass with its result: the handler keeps owning it (the server sends it, never closes
    it). A reply that cannot be delivered ends the connection, so ``disconnected``
    follows: a lease granted on it then has no holder. A handler may also have
    ``holds_leases(peer) -> bool``: an idle connection for which it says yes stays open;
    ``attach_push(push)``: the server hands it :meth:`AgentServer.push` at start; and
    ``fd_sent(peer, fd)``: called once a reply carrying ``fd`` was sent (or failed to).
    """

    def hello(self, peer: Peer, args: HelloArgs) -> HelloResult: ...

    def lease(self, peer: Peer, args: LeaseArgs) -> tuple[LeaseResult, int]: ...

    def renew(self, peer: Peer, args: RenewArgs) -> RenewResult: ...

    def release(self, peer: Peer, args: ReleaseArgs) -> ReleaseResult: ...

    def shrink(self, peer: Peer, args: ShrinkArgs) -> ShrinkResult: ...

    def list(self, peer: Peer, args: ListArgs) -> ListResult: ...

    def stats(self, peer: Peer, args: StatsArgs) -> StatsResult: ...

    def report(self, peer: Peer, args: ReportArgs) -> ReportResult: ...

    def disconnected(self, peer: Peer) -> None: ...


def bind_handler(
    handler: object,
) -> tuple[dict[str, Callable[[Peer, Model], Any]], Callable[[Peer], None]]:
    """The handler's method per operation and its ``disconnected``; TypeError if any is missing."""
    methods: dict[str, Callable[[Peer, Model], Any]] = {}
    missing: list[str] = []
    for name in OPERATIONS:
        method = getattr(handler, name, None)
        if callable(method):
            methods[name] = method
        else:
            missing.append(name)
    disconnected: Callable[[Peer], None] | None = getattr(handler, "disconnected", None)
    if not callable(disconnected):
        missing.append("disconnected")
    if missing or disconnected is None:
        raise TypeError(
            f"{type(handler).__name__} cannot serve the agent protocol: "
            f"no method for {', '.join(missing)}"
        )
    return methods, disconnected
