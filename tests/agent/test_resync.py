"""The reconciliation after a failed exchange (agent/resync.py): its two-look rule.

Resync is pure bookkeeping over what the link, the held table and the memory layer
say; here those answer from plain sets, so each case states exactly what poold lists
and what the agent knows at each look. The full stack (a lost grant reply, retried
and reconciled against a real poold) is tests/e2e/test_failover.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from agent.held import HeldLeases
from agent.link import PooldLink
from agent.memory import LeaseMemory
from agent.resync import Resync
from poold.errors import PooldUnreachable
from poold.wire.agent import LeaseOp


@dataclass
class FakeClient:
    live: dict[str, str] = field(default_factory=dict)  # lease id -> state
    down: bool = False
    calls: int = 0

    def list_leases(self, **_: Any) -> list[SimpleNamespace]:
        self.calls += 1
        if self.down:
            raise PooldUnreachable("poold is down")
        return [SimpleNamespace(id=i, state=s) for i, s in self.live.items()]


@dataclass
class FakeLink:
    client: FakeClient = field(default_factory=FakeClient)
    in_flight: set[int] = field(default_factory=set)
    unsettled_ids: set[str] = field(default_factory=set)
    queued: set[str] = field(default_factory=set)
    sent: list[LeaseOp] = field(default_factory=list)

    def grants_in_flight(self) -> set[int]:
        return set(self.in_flight)

    def unsettled(self) -> set[str]:
        return set(self.unsettled_ids)

    def queued_lease_ids(self) -> set[str]:
        return set(self.queued)

    def enqueue(self, op: LeaseOp) -> None:
        self.sent.append(op)


@dataclass
class FakeHeld:
    held: set[str] = field(default_factory=set)

    def ids(self) -> list[str]:
        return sorted(self.held)


@dataclass
class FakeMemory:
    scrubbing: set[str] = field(default_factory=set)

    def scrubbing_ids(self) -> set[str]:
        return set(self.scrubbing)


def make() -> tuple[Resync, FakeLink, FakeHeld, FakeMemory]:
    link, held, memory = FakeLink(), FakeHeld(), FakeMemory()
    resync = Resync("h1", cast(PooldLink, link), cast(HeldLeases, held), cast(LeaseMemory, memory))
    return resync, link, held, memory


def ops(link: FakeLink) -> list[tuple[str, str]]:
    return [(op.lease_id, op.op) for op in link.sent]


def test_nothing_is_asked_until_an_exchange_fails() -> None:
    resync, link, _, _ = make()
    link.client.live = {"stray": "granted"}
    assert not resync.due
    resync.step()
    assert link.client.calls == 0 and link.sent == []


def test_a_stray_seen_at_both_looks_is_ended_by_its_state() -> None:
    resync, link, held, _ = make()
    link.client.live = {"g": "granted", "a": "active", "mine": "active", "r": "revoking"}
    held.held = {"mine"}
    resync.failed()
    assert resync.due
    resync.step()  # first look: suspects only
    assert link.sent == [] and resync.due
    resync.step()  # second look: confirmed
    assert sorted(ops(link)) == [("a", "orphan"), ("g", "abort")]
    assert not resync.due
    resync.step()
    assert link.client.calls == 2  # a round done, no failure since: no more looks


def test_a_lease_the_agent_comes_to_hold_between_the_looks_is_left_alone() -> None:
    resync, link, held, _ = make()
    link.client.live = {"late": "granted"}
    resync.failed()
    resync.step()
    held.held = {"late"}  # the grant's reply arrived and the tenant holds it
    resync.step()
    assert link.sent == []


def test_every_kind_of_knowing_protects_a_lease() -> None:
    resync, link, held, memory = make()
    link.client.live = {x: "active" for x in ("held", "scrub", "unsettled", "queued", "stray")}
    held.held = {"held"}
    memory.scrubbing = {"scrub"}
    link.unsettled_ids = {"unsettled"}
    link.queued = {"queued"}
    resync.failed()
    resync.step()
    resync.step()
    assert ops(link) == [("stray", "orphan")]


def test_the_second_look_waits_for_the_grants_running_at_the_first() -> None:
    resync, link, _, _ = make()
    link.client.live = {"x": "granted"}
    link.in_flight = {7}
    resync.failed()
    resync.step()
    resync.step()  # grant 7 still runs: its lease may be x
    assert link.sent == [] and link.client.calls == 1
    link.in_flight = {8}  # 7 ended; a grant begun after the first look does not hold it up
    resync.step()
    assert ops(link) == [("x", "abort")]


def test_a_lease_gone_by_the_second_look_is_not_touched() -> None:
    resync, link, _, _ = make()
    link.client.live = {"x": "granted"}
    resync.failed()
    resync.step()
    link.client.live = {"y": "granted"}  # x ended on its own; y is new, not a suspect
    resync.step()
    assert link.sent == []
    assert not resync.due


def test_a_failure_during_a_round_calls_for_another() -> None:
    resync, link, _, _ = make()
    link.client.live = {"x": "granted"}
    resync.failed()
    resync.step()
    resync.failed()  # between the looks
    resync.step()
    assert ops(link) == [("x", "abort")]
    assert resync.due  # the second failure is the next round's
    link.client.live = {}
    resync.step()
    assert not resync.due


def test_poold_still_down_keeps_the_round_pending() -> None:
    resync, link, _, _ = make()
    link.client.down = True
    resync.failed()
    resync.step()
    assert resync.due and link.sent == []
    link.client.down = False
    resync.step()  # nothing unknown at the first look: the round is done
    assert not resync.due
