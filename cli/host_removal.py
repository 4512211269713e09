"""How does `poolctl hosts delete --force` take a host's leases back before the host goes?

Deleting a host kills its agent's credential in the same commit, so nothing said to the
agent after it arrives. Ending the host's leases in that commit (what `--force` did) left
the agent unaware and its tenants using memory the ledger called free. So first:

1. the host is drained (no new lease is placed on it while we wait);
2. each live lease is ended as `poolctl leases end` ends one: a held lease is revoked
   due now (reason "host deleted"), so the agent hears it in its next heartbeat reply
   or news, tears it down and tells its tenant (revoked, then lost); an orphaned lease
   is reclaimed, a granted one aborted;
3. we wait, at most `wait_s`, until the host holds no live lease or its agent stops
   answering (status `down`, or no new heartbeat for `silent_s`): then nobody uses
   that memory through poold;
4. only then is the host deleted (what is still live, its agent being gone, is ended
   by the deletion as before). A host that still holds leases at the end of the wait
   while its agent answers is not deleted: `host_busy`, the leases stay revoked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from poold.api.client import PooldClient
from poold.errors import HostBusy, PoolError, UnknownHost
from poold.wire.admin import HostDeleted, HostOut
from poold.wire.common import LeaseOut

REASON = "host deleted"
POLL_S = 0.2
PROGRESS_EVERY_S = 2.0


@dataclass
class LeaseOutcome:
    """What became of one lease the host held when its deletion began."""

    lease_id: str
    was: str  # its state then
    asked: str  # what ending it did: revoked / reclaimed / aborted / none, or a refusal code
    outcome: str = ""  # ended_before_deletion (while its agent could hear) / ended_with_host
    state: str = ""  # its state after the deletion

    def as_dict(self) -> dict[str, str]:
        return {
            "lease_id": self.lease_id,
            "was": self.was,
            "asked": self.asked,
            "outcome": self.outcome,
            "state": self.state,
        }


@dataclass
class ForcedDeletion:
    """The deletion, and each lease's outcome."""

    deleted: HostDeleted
    leases: list[LeaseOutcome] = field(default_factory=list)
    waited_s: float = 0.0
    agent_gone: bool = False  # the wait ended because the agent stopped answering


def _host(client: PooldClient, name: str) -> HostOut:
    for host in client.list_hosts():
        if host.name == name:
            return host
    raise UnknownHost(f"no host {name!r}", host=name)


def _live(client: PooldClient, name: str) -> list[LeaseOut]:
    return client.list_leases(host=name, live=True)


def _end(client: PooldClient, lease: LeaseOut) -> str:
    """End one lease as `leases end` does; what it did, or the code refusing it (a lease
    being zeroed or still mapped ends when its agent reports it: it is waited for)."""
    try:
        return client.end_lease(lease.id, REASON).action
    except PoolError as err:
        return err.code


def delete_forced(
    client: PooldClient,
    name: str,
    *,
    wait_s: float,
    silent_s: float,
    progress: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
) -> ForcedDeletion:
    """Revoke the host's leases, wait for its agent to tear them down, then delete it."""
    host = _host(client, name)
    if host.status != "draining":
        client.drain_host(name)  # no new lease on it while we wait
    outcomes: dict[str, LeaseOutcome] = {}
    start = clock()
    last_beat: datetime | None = host.last_heartbeat_at
    beat_seen_at = start
    last_said = start
    agent_gone = host.status == "down"
    while True:
        live = _live(client, name)
        for lease in live:
            if lease.id not in outcomes:  # new ones too: a grant that raced the drain
                outcomes[lease.id] = LeaseOutcome(lease.id, lease.state.value, _end(client, lease))
        if not live or agent_gone:
            if live and agent_gone:  # down before we began: no wait for it
                progress(
                    f"host {name}: its agent does not answer (the host is down); deleting "
                    f"with {len(live)} live lease(s)"
                )
            break
        now = clock()
        host = _host(client, name)
        if host.last_heartbeat_at != last_beat:
            last_beat, beat_seen_at = host.last_heartbeat_at, now
        if host.status == "down" or now - beat_seen_at >= silent_s:
            agent_gone = True
            progress(
                f"host {name}: its agent does not answer (no heartbeat for "
                f"{now - beat_seen_at:.0f}s); deleting with {len(live)} live lease(s)"
            )
            break
        if now - start >= wait_s:
            raise HostBusy(
                f"host {name!r} still holds {len(live)} live lease(s) after {wait_s:g}s and "
                "its agent still answers: not deleted (the host is draining and its leases "
                "are revoked; a tenant still mapping a memfd keeps it: see `poolctl leases "
                "list --host`). Wait longer with --wait-s, or stop the agent",
                host=name,
                live_leases=len(live),
                lease_ids=[x.id for x in live],
            )
        if now - last_said >= PROGRESS_EVERY_S:
            last_said = now
            progress(
                f"host {name}: waiting for its agent to tear down {len(live)} lease(s) "
                f"({wait_s - (now - start):.0f}s left)"
            )
        time.sleep(POLL_S)
    deleted = client.delete_host(name, force=True)
    ended = set(deleted.ended_leases)
    for outcome in outcomes.values():
        outcome.outcome = (
            "ended_with_host" if outcome.lease_id in ended else "ended_before_deletion"
        )
        outcome.state = client.show_lease(outcome.lease_id).state.value
    return ForcedDeletion(
        deleted=deleted,
        leases=sorted(outcomes.values(), key=lambda x: x.lease_id),
        waited_s=round(clock() - start, 3),
        agent_gone=agent_gone,
    )
