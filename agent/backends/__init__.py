"""What must a memory backend provide so that the agent can turn a grant into an fd?

A backend turns "this lease, this many bytes" into a file descriptor a tenant can
mmap, and takes it back. The emulated backend (memfd on ordinary RAM) lives in
:mod:`agent.backends.emulated`, the devdax one (a dax sub-device per lease) in
:mod:`agent.backends.devdax`, the numa one (a memfd bound to a far node) in
:mod:`agent.backends.numa`; all three implement the whole :class:`Backend` protocol, so
the agent never asks which class it holds: what differs between them is a method or an
attribute here (where a placed lease's memory comes from, whether revoking takes the pages
back, what a scrub or a sub-device is), and what differs between the memories they make is
on :class:`Materialised`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from poold.wire.common import DeviceKind

# Called with a dax sub-device's name after it is picked and before it holds a byte
# (agent/backends/devdax.py): the agent journals it there, so no crash leaves a sized
# sub-device the agent never heard of.
OnCarve = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Materialised:
    """Memory made real for one lease. The backend owns ``fd`` until :meth:`Backend.release`."""

    fd: int
    backend: DeviceKind
    length_bytes: int
    page_size_bytes: int
    numa_node: int | None = None
    # Every page allocated, zeroed and faulted in before the reply (a pin-ready lease:
    # cudaHostRegister / ibv_reg_mr then pin without allocating); device memory always is.
    populated: bool = False

    @property
    def sub_device(self) -> str | None:
        """The dax sub-device this memory is ("dax0.2"); None for memory that is no device."""
        return None

    @property
    def dax_region_id(self) -> int | None:
        """The dax region of :attr:`sub_device`; None when there is no sub-device."""
        return None

    def can_shrink(self) -> bool:
        """Whether ``ftruncate`` may cut this memory down in place (a memfd not sealed
        against shrinking), checked on the fd, not assumed from what was asked."""
        return False


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a lease poold (or the agent's delegation) placed must be made on this host:
    each backend takes from it what it understands (the range and dax region for devdax,
    the node for numa, only the length for emulated memory)."""

    device_uid: str
    offset_bytes: int
    length_bytes: int
    dax_region_id: int | None = None
    numa_node: int | None = None
    # What the tenant asked for (pin-ready leases), for the memfd backends: a page size
    # mode (off|prefer|required; None: the backend's own), every page faulted in before
    # the reply, and the node the memory must be on (agent/memory.py binds emulated
    # memory there through the numa backend).
    hugepages: str | None = None
    populate: bool = False
    wanted_node: int | None = None


class Backend(Protocol):
    """Turns granted leases into mmap-able fds, and takes them back."""

    @property
    def name(self) -> DeviceKind:
        """The backend kind, as reported on the wire (``LeaseResult.backend``)."""
        ...

    @property
    def revoke_unmaps(self) -> bool:
        """Whether taking memory back unmaps it from every process that maps it (a
        destroyed dax sub-device); a memfd's pages stay with whoever still maps them."""
        ...

    def materialise(
        self, length_bytes: int, name: str, *, shrinkable: bool = False
    ) -> Materialised:
        """Exactly ``length_bytes`` of zeroed or fresh memory, wherever this backend puts
        memory that has no placement (a backend that needs one refuses); ``name`` is for
        humans.

        ``shrinkable``: a memfd left unsealed against shrinking, where the backend makes
        memfds (the agent checks the seals before it tells the tenant)."""
        ...

    def materialise_placed(
        self,
        placement: Placement,
        name: str,
        *,
        shrinkable: bool = False,
        on_carve: OnCarve | None = None,
    ) -> Materialised:
        """Memory for a placed lease, made where its placement says; ``backend_failed``
        when the placement lacks what this backend needs (the dax region, the node).

        ``shrinkable`` as for :meth:`materialise`; ``on_carve`` where the backend carves
        sub-devices (see :data:`OnCarve`)."""
        ...

    def release(self, materialised: Materialised) -> None:
        """Give the memory back; the agent's fd is closed afterwards."""
        ...

    def revoke(self, region_id: int, sub_device: str) -> None:
        """Destroy a sub-device known only by name (a lease re-adopted from the journal, a
        leftover), whoever maps it; ``backend_failed`` where the backend carves none."""
        ...

    def scrub(
        self,
        region_id: int,
        offset_bytes: int,
        length_bytes: int,
        *,
        on_carve: OnCarve | None = None,
        on_deleted: Callable[[str], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        """Zero a released range of a dax region; True when it read back zero.
        ``backend_failed`` where the backend's memory is never reused (fresh memfd pages)."""
        ...

    def sub_device_sizes(self, region_id: int) -> dict[str, int]:
        """The sub-devices this backend may have carved in the region, with their sizes in
        bytes; {} where it carves none (a static region, a memfd backend)."""
        ...
