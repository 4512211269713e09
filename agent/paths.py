"""Where does the agent's socket live?

The agent listens where :func:`default_socket_path` says for the user running it:
``/run/poold/agent.sock`` for root (the production, one-per-host agent), a per-user
runtime directory otherwise (development). A tenant looks in ``$POOLD_AGENT_SOCKET``
first, then at the host agent's path, then at its own per-user path
(:func:`client_socket_path`), because tenants are not root but the host agent is.
"""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_ENV = "POOLD_AGENT_SOCKET"
SYSTEM_SOCKET_PATH = Path("/run/poold/agent.sock")


def default_socket_path(uid: int | None = None) -> Path:
    """Where an agent run by ``uid`` (default: this process's euid) listens."""
    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return SYSTEM_SOCKET_PATH
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return Path(runtime_dir) / "poold" / "agent.sock"
    return Path(f"/tmp/poold-{uid}") / "agent.sock"  # noqa: S108  # per-uid dir, like ssh-agent


def client_socket_path() -> Path:
    """Where a tenant should connect when it was not told: env, host agent, own agent."""
    from_env = os.environ.get(SOCKET_ENV)
    if from_env:
        return Path(from_env)
    if SYSTEM_SOCKET_PATH.exists():
        return SYSTEM_SOCKET_PATH
    return default_socket_path()
