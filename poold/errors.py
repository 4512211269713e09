"""The one place where poold's stable error codes live.

Every failure a caller can act on is a `PoolError` subclass carrying a `code`
(stable across releases: tests and clients match on it, never on the message)
and the HTTP status the API maps it to. The agent socket and poolctl reuse the
same codes, so an error reads the same wherever it surfaces. Each code belongs to
exactly one class: a class that claims a taken code (or inherits its parent's)
is refused when it is defined.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DuplicateErrorCode(TypeError):
    """Two PoolError classes claim one code: a client could not tell which one was raised."""


# code -> the one class that carries it; filled as each class is defined, so a second
# class claiming a code fails its own import instead of shadowing the first on the wire.
_BY_CODE: dict[str, type[PoolError]] = {}


def _register(cls: type[PoolError]) -> None:
    if "code" not in vars(cls):
        raise DuplicateErrorCode(
            f"{cls.__module__}.{cls.__qualname__} inherits code {cls.code!r}: give it its own"
        )
    taken = _BY_CODE.get(cls.code)
    if taken is not None:
        raise DuplicateErrorCode(
            f"{cls.__module__}.{cls.__qualname__} claims code {cls.code!r}, "
            f"already {taken.__module__}.{taken.__qualname__}'s"
        )
    _BY_CODE[cls.code] = cls


class PoolError(Exception):
    """Base of every error with a stable code."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.detail:
            body["detail"] = self.detail
        return body


_register(PoolError)


class BadRequest(PoolError):
    code = "bad_request"
    http_status = 400


class InvalidSize(BadRequest):
    code = "invalid_size"


class FrameTooLarge(BadRequest):
    code = "frame_too_large"


class Unauthorized(PoolError):
    code = "unauthorized"
    http_status = 401


class Forbidden(PoolError):
    code = "forbidden"
    http_status = 403


class NotOwner(PoolError):
    """The caller's uid/gid may not act for that tenant, or the lease is someone else's."""

    code = "not_owner"
    http_status = 403


class NotFound(PoolError):
    code = "not_found"
    http_status = 404


class UnknownTenant(NotFound):
    code = "unknown_tenant"


class UnknownHost(NotFound):
    code = "unknown_host"


class UnknownLease(NotFound):
    code = "unknown_lease"


class UnknownDevice(NotFound):
    code = "unknown_device"


class Conflict(PoolError):
    code = "conflict"
    http_status = 409


class AlreadyExists(Conflict):
    code = "already_exists"


class LeaseNotActive(Conflict):
    """A transition asked of a lease whose state does not allow it (renew after release...)."""

    code = "lease_not_active"


class InvalidTransition(Conflict):
    code = "invalid_transition"


class GenerationConflict(Conflict):
    """Optimistic concurrency lost too many times in a row; the caller may retry."""

    code = "generation_conflict"


class TenantInUse(Conflict):
    code = "tenant_in_use"


class HostBusy(Conflict):
    """A host still holds live leases: `poolctl hosts delete --force` ends them first."""

    code = "host_busy"


class NotShrinkable(Conflict):
    """The lease's memory cannot be cut down in place (devdax, a sealed memfd, re-adopted)."""

    code = "not_shrinkable"


class QuotaExceeded(PoolError):
    code = "quota_exceeded"
    http_status = 409


class NoCapacity(PoolError):
    code = "no_capacity"
    http_status = 507


class PooldUnreachable(PoolError):
    code = "poold_unreachable"
    http_status = 503


class CommandLineError(PoolError):
    """A command line was refused before anything ran (poolctl's usage errors; exit 2)."""

    code = "usage"
    http_status = 400


class ConfigInvalid(PoolError):
    """A daemon's flags, environment or config file were refused at start (exit 2)."""

    code = "config_invalid"
    http_status = 400


class Interrupted(PoolError):
    """Ctrl-C stopped a command (poolctl; exit 130). Never sent by a daemon."""

    code = "interrupted"
    http_status = 499


class LedgerUnavailable(PoolError):
    """The ledger database is down, failing over or refusing connections: retry later.

    Nothing was committed by the request that got it (the transaction was rolled
    back, or never began), so a retry with the same request id is always safe.
    """

    code = "ledger_unavailable"
    http_status = 503


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


class BackendFailed(PoolError):
    """The agent could not turn a grant into memory (memfd, devdax...)."""

    code = "backend_failed"
    http_status = 500


def all_codes() -> dict[str, type[PoolError]]:
    """Every code and its one class, for lookups from wire bodies back to exception types."""
    return dict(_BY_CODE)


def from_wire(code: str, message: str, detail: dict[str, Any] | None = None) -> PoolError:
    """Rebuild the exception a server sent, so clients raise what the server raised."""
    cls = all_codes().get(code)
    if cls is None:
        err = PoolError(message, **(detail or {}))
        err.code = code  # type: ignore[misc]  # keep an unknown server code visible to callers
        return err
    return cls(message, **(detail or {}))


class BodyTooLarge(PoolError):
    """A request body past poold's cap (`--max-body-bytes`): refused before it is read whole."""

    code = "body_too_large"
    http_status = 413


class DeviceNotBound(Forbidden):
    """A host reported a device it is not bound to (poold/ledger/device_hosts.py): the
    inventory item is dropped, and the rest of the heartbeat still applies."""

    code = "device_not_bound"


class DeviceHostScoped(Conflict):
    """`allow-host` of a second host for a device only one host can reach (emulated
    memory, a host's own NUMA node or dax region)."""

    code = "device_host_scoped"


class InFlightLimit(PoolError):
    """Too much lease work in flight on the agent, for this uid or host-wide: retry shortly.

    Nothing was made for the refused request, and a lease granted for it was aborted.
    """

    code = "in_flight_limit"
    http_status = 429


class FrameTimeout(BadRequest):
    """A socket peer began a frame and did not finish it in time; the agent hung up."""

    code = "frame_timeout"


class DeadlineTooShort(BadRequest):
    """A revocation deadline shorter than poold can tell the tenant in (0 is allowed: it
    means now, and the tenant hears only that the lease is lost)."""

    code = "deadline_too_short"


class DelegationExpired(PoolError):
    """The agent held a delegation (reservations, budgets) the request would have fit, but
    its TTL passed without poold renewing it (poold down), and poold could not grant
    centrally either: retry once poold answers again."""

    code = "delegation_expired"
    http_status = 503


class UnknownReservation(NotFound):
    """No reservation with that id (never made, or returned and gone)."""

    code = "unknown_reservation"


class ReservationInUse(Conflict):
    """A reservation given back while a live lease lies in it: give it back once they end."""

    code = "reservation_in_use"


class OutsideReservation(Conflict):
    """A local grant whose extent (or epoch) does not lie inside its reservation."""

    code = "outside_reservation"


class LeaseOverlap(Conflict):
    """A local grant whose extent overlaps a live lease already in the ledger."""

    code = "lease_overlap"


class LocalGrantMismatch(Conflict):
    """A local grant repeated under a lease id the ledger has with different fields."""

    code = "local_grant_mismatch"


class BudgetExceeded(PoolError):
    """A local grant that would take the tenant past its budget on that host."""

    code = "budget_exceeded"
    http_status = 409
