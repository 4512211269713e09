"""What must a memory backend provide so that the agent can turn a grant into an fd?

A backend turns "this lease, this many bytes" into a file descriptor a tenant can
mmap, and takes it back. The emulated backend (memfd on ordinary RAM) lives in
:mod:`agent.backends.emulated`; devdax and numa backends slot in behind the same
:class:`Backend` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from poold.wire.common import DeviceKind


@dataclass(frozen=True, slots=True)
class Materialised:
    """Memory made real for one lease. The backend owns ``fd`` until :meth:`Backend.release`."""

    fd: int
    backend: DeviceKind
    length_bytes: int
    page_size_bytes: int
    numa_node: int | None = None


class Backend(Protocol):
    """Turns granted lease lengths into mmap-able fds, and takes them back."""

    @property
    def name(self) -> DeviceKind:
        """The backend kind, as reported on the wire (``LeaseResult.backend``)."""
        ...

    def materialise(
        self, length_bytes: int, name: str, *, shrinkable: bool = False
    ) -> Materialised:
        """Exactly ``length_bytes`` of zeroed or fresh memory; ``name`` is for humans.

        ``shrinkable``: a memfd left unsealed against shrinking, where the backend makes
        memfds (the agent checks the seals before it tells the tenant)."""
        ...

    def release(self, materialised: Materialised) -> None:
        """Give the memory back; the agent's fd is closed afterwards."""
        ...
