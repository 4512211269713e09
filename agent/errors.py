"""Which failures belong to the agent's socket itself, rather than to poold's decisions?

They extend :mod:`poold.errors` (same base, same wire shape) so that a tenant matches
on ``err.code`` whichever side failed, and :func:`poold.errors.from_wire` rebuilds them
once this module is imported. Candidates to move into ``poold/errors.py``.
"""

from __future__ import annotations

from poold.errors import PoolError


class AgentUnreachable(PoolError):
    """The tenant could not reach the host's agent (no socket, refused, timed out, dropped)."""

    code = "agent_unreachable"
    http_status = 503


class AgentBusy(PoolError):
    """The agent is at its connection cap; retry later or reuse a connection."""

    code = "agent_busy"
    http_status = 503


class AgentProtocolError(PoolError):
    """The agent's reply broke the socket protocol (a version skew or a bug, never the tenant)."""

    code = "agent_protocol_error"
    http_status = 502
