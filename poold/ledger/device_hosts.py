"""Which hosts may report a device, and so reach it for placement?

One agent credential must not rewrite another host's device: an inventory item
changes a device (capacity, health, media, reserved extents) and creates the
reporting host's path to it, the path placement puts that host's grants on. So
every device is bound to the hosts that may report it (`device_hosts`):

* the device's first report (no row for its uid yet) binds the reporting host,
  except that a host-scoped uid naming another registered host (``emulated:Y``,
  ``Y/numa:node2``) is refused even then;
* after that, only a bound host may report it. An administrator binds more
  hosts to a shared device (``poolctl devices allow-host``) and unbinds any
  (``disallow-host``); a host-scoped device has at most one host.

The scope comes from the uid alone (the agent's scheme, agent/discovery/model.py
and agent/inventory.py), never from what a report claims: a uid carrying the
agent's host prefix (``host/...``), an emulated one, or one named by host-physical
addresses or node numbers is host-scoped; a CXL identity made of memdev serials
(``cxl:...:serials=...``, ``numa:cxl:...``) is shared. Matching serials prove
nothing beyond the uid itself, which anyone who saw ``poolctl devices`` knows.

A refused item is dropped from the heartbeat (the rest still applies), listed in
the reply with code ``device_not_bound``, and logged once per (host, device) per
process.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from poold.errors import DeviceHostScoped, DeviceNotBound
from poold.ledger import devices, hosts, transitions
from poold.ledger.db import Ledger
from poold.ledger.models import Device, DeviceHost, DevicePath, Host
from poold.ledger.types import utcnow
from poold.wire.admin import DeviceHosts, DeviceScope

log = logging.getLogger("poold.ledger.device_hosts")

# CXL identities built from memdev serials (region_identities): the same hardware
# seen from every head of a multi-headed or switched device.
SHARED_PREFIXES = ("cxl:", "numa:cxl:")
# Identities the agent builds from host-physical addresses when a serial is unreadable:
# the same name could be different memory on another host.
HOST_LOCAL_MARKS = (":resource=",)


def scope_of(uid: str) -> DeviceScope:
    """ "host" or "shared", from the uid's scheme alone (pure)."""
    if "/" in uid:  # agent/discovery/inventory.py wire_uid: "<host>/<identity>"
        return "host"
    if uid.startswith(SHARED_PREFIXES) and not any(m in uid for m in HOST_LOCAL_MARKS):
        return "shared"
    return "host"  # emulated:<host>, and any scheme poold does not know: one host only


def named_host(uid: str) -> str | None:
    """The host a host-scoped uid names (``emulated:Y``, ``Y/...``), or None (pure)."""
    if scope_of(uid) != "host":
        return None
    if "/" in uid:
        return uid.partition("/")[0] or None
    if uid.startswith("emulated:"):
        return uid.removeprefix("emulated:") or None
    return None


def bound_host_ids(session: Session, device_id: int) -> list[int]:
    return list(
        session.scalars(
            select(DeviceHost.host_id)
            .where(DeviceHost.device_id == device_id)
            .order_by(DeviceHost.host_id)
        )
    )


def bind(session: Session, device_id: int, host_id: int, source: str) -> None:
    session.add(
        DeviceHost(device_id=device_id, host_id=host_id, source=source, created_at=utcnow())
    )


def refusal(session: Session, host: Host, uid: str, dev: Device | None) -> DeviceNotBound | None:
    """Why `host` may not report device `uid` (None: it may; a new device is bound to it
    by the caller, an unbound host-scoped one that names this host is bound here).

    ``dev`` is the device row of that uid, None at its first sight.
    """
    if dev is None:
        owner = named_host(uid)
        if owner is not None and owner != host.name:
            other = session.scalar(select(Host.id).where(Host.name == owner))
            if other is not None:
                return DeviceNotBound(
                    f"device {uid!r} names host {owner!r}; host {host.name!r} may not report it",
                    uid=uid,
                    host=host.name,
                )
        return None
    bound = session.scalar(
        select(DeviceHost.id).where(DeviceHost.device_id == dev.id, DeviceHost.host_id == host.id)
    )
    if bound is not None:
        return None
    if (
        scope_of(uid) == "host"
        and named_host(uid) == host.name
        and not bound_host_ids(session, dev.id)
    ):
        # A host-scoped device that names this host and has no host at all (its host
        # was deleted and added again): it is this host's, as at its first sight.
        bind(session, dev.id, host.id, "named_host")
        return None
    if scope_of(uid) == "host":
        why = "it is host-scoped and bound to another host"
    else:
        why = f"an administrator has not allowed it (poolctl devices allow-host {uid} {host.name})"
    return DeviceNotBound(
        f"host {host.name!r} may not report device {uid!r}: {why}", uid=uid, host=host.name
    )


# (host name, device uid) pairs refused and logged by this process: logged once, not per
# heartbeat. Bounded: past the cap it starts over (a pair is then logged once more).
_LOGGED: set[tuple[str, str]] = set()
_LOGGED_CAP = 10_000
_LOGGED_LOCK = threading.Lock()


def log_refusal(host: str, uid: str, message: str) -> None:
    """Log a refused inventory item the first time this process sees the pair."""
    with _LOGGED_LOCK:
        if (host, uid) in _LOGGED:
            return
        if len(_LOGGED) >= _LOGGED_CAP:
            _LOGGED.clear()
        _LOGGED.add((host, uid))
    log.warning("inventory item refused (device_not_bound): %s", message)


def forget_refusal(host: str, uid: str) -> None:
    """The pair is accepted now: a later refusal is news again."""
    with _LOGGED_LOCK:
        _LOGGED.discard((host, uid))


def _out(session: Session, dev: Device) -> DeviceHosts:
    names = session.scalars(
        select(Host.name)
        .join(DeviceHost, DeviceHost.host_id == Host.id)
        .where(DeviceHost.device_id == dev.id)
        .order_by(Host.name)
    )
    return DeviceHosts(uid=dev.uid, scope=scope_of(dev.uid), hosts=list(names))


def allowed_hosts(session: Session, device_ids: list[int]) -> dict[int, list[str]]:
    """Each device's bound host names, sorted (for status views)."""
    out: dict[int, list[str]] = {i: [] for i in device_ids}
    for chunk in transitions.chunks(device_ids):
        for device_id, name in session.execute(
            select(DeviceHost.device_id, Host.name)
            .join(Host, Host.id == DeviceHost.host_id)
            .where(DeviceHost.device_id.in_(chunk))
            .order_by(Host.name)
        ):
            out[device_id].append(name)
    return out


def allow(session: Session, uid: str, host_name: str, actor: str) -> DeviceHosts:
    """Bind a host to a device; journaled. Allowing a bound host changes nothing."""
    dev = devices.get_by_uid(session, uid)
    host = hosts.get_by_name(session, host_name)
    bound = bound_host_ids(session, dev.id)
    if host.id in bound:
        return _out(session, dev)
    if scope_of(uid) == "host" and bound:
        raise DeviceHostScoped(
            f"device {uid!r} is host-scoped and already bound to another host; "
            "disallow that host first",
            uid=uid,
            host=host_name,
        )
    bind(session, dev.id, host.id, "admin")
    # The host may have sent this device before and had it refused; its agent sends the
    # inventory again only when asked (want_inventory), which a cleared digest does.
    host.inventory_digest = None
    transitions.record(
        session,
        transitions.event_row(
            actor=actor,
            kind="device.allow_host",
            device_id=dev.id,
            host_id=host.id,
            detail={"uid": uid, "host": host_name},
        ),
    )
    session.flush()
    forget_refusal(host_name, uid)
    return _out(session, dev)


def disallow(session: Session, uid: str, host_name: str, actor: str) -> DeviceHosts:
    """Unbind a host from a device: its path goes absent at once, so no grant of that host
    is placed there; live leases stay until they end (drain or revoke them to hurry)."""
    dev = devices.get_by_uid(session, uid)
    host = hosts.get_by_name(session, host_name)
    binding = session.scalar(
        select(DeviceHost).where(DeviceHost.device_id == dev.id, DeviceHost.host_id == host.id)
    )
    if binding is None:
        return _out(session, dev)
    session.delete(binding)
    path = session.scalar(
        select(DevicePath).where(DevicePath.device_id == dev.id, DevicePath.host_id == host.id)
    )
    if path is not None and path.present:
        path.present = False
        # A grant of this host that read the path before this commits loses its swap
        # and places again, without this device (STYLE.md pattern 1).
        generation = transitions.bump(session.connection(), Device, dev.id)
        set_committed_value(dev, "generation", generation)  # what the row now holds
        others = session.scalar(
            select(DevicePath.id)
            .where(
                DevicePath.device_id == dev.id,
                DevicePath.present.is_(True),
                DevicePath.host_id != host.id,
            )
            .limit(1)
        )
        if others is None and dev.state == "online":
            dev.state = "missing"  # as a device no host reaches (heartbeat.upsert_inventory)
            dev.updated_at = utcnow()
            transitions.record(
                session,
                transitions.event_row(
                    actor=actor, kind="device.missing", device_id=dev.id, host_id=host.id
                ),
            )
    transitions.record(
        session,
        transitions.event_row(
            actor=actor,
            kind="device.disallow_host",
            device_id=dev.id,
            host_id=host.id,
            detail={"uid": uid, "host": host_name},
        ),
    )
    session.flush()
    return _out(session, dev)


# --- entry points: each owns its transaction (the API opens none) -------------------


def allow_host(ledger: Ledger, uid: str, host_name: str, actor: str) -> DeviceHosts:
    """`allow` in a transaction of its own, run again if the database aborts it."""

    def attempt() -> DeviceHosts:
        with ledger.write() as session:
            return allow(session, uid, host_name, actor)

    return transitions.retrying(attempt, what=f"allow-host {host_name} on {uid}")


def disallow_host(ledger: Ledger, uid: str, host_name: str, actor: str) -> DeviceHosts:
    """`disallow` in a transaction of its own, run again if the database aborts it."""

    def attempt() -> DeviceHosts:
        with ledger.write() as session:
            return disallow(session, uid, host_name, actor)

    return transitions.retrying(attempt, what=f"disallow-host {host_name} on {uid}")


def device_hosts(ledger: Ledger, uid: str) -> DeviceHosts:
    with ledger.read() as session:
        return _out(session, devices.get_by_uid(session, uid))
