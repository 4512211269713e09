"""The lease state machine: every (state, event) pair, allowed or refused with its code."""

from __future__ import annotations

import itertools

import pytest

from poold.errors import InvalidTransition, LeaseNotActive, PoolError
from poold.lease_states import (
    HELD_STATES,
    LIVE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    LeaseEvent,
    LeaseState,
    next_state,
)
from poold.ledger.models import LIVE_STATES_SQL

S, E = LeaseState, LeaseEvent

# The lifecycle diagram of DESIGN.md, written out independently of the module.
ALLOWED: dict[tuple[LeaseState, LeaseEvent], LeaseState] = {
    (S.GRANTED, E.ACTIVATE): S.ACTIVE,
    (S.GRANTED, E.ABORT): S.ABORTED,
    (S.GRANTED, E.RELEASE): S.RELEASED,
    (S.GRANTED, E.RENEW): S.GRANTED,
    (S.ACTIVE, E.RENEW): S.ACTIVE,
    (S.ACTIVE, E.RELEASE): S.RELEASED,
    (S.ACTIVE, E.RELEASE_DIRTY): S.SCRUBBING,
    (S.ACTIVE, E.EXPIRE): S.EXPIRED,
    (S.ACTIVE, E.ORPHAN): S.ORPHANED,
    (S.ACTIVE, E.REVOKE): S.REVOKING,
    (S.ORPHANED, E.ADOPT): S.ACTIVE,
    (S.ORPHANED, E.RECLAIM): S.RECLAIMED,
    (S.ORPHANED, E.RECLAIM_DIRTY): S.SCRUBBING,
    (S.ORPHANED, E.REVOKE): S.REVOKING,
    (S.EXPIRED, E.RECLAIM): S.RECLAIMED,
    (S.EXPIRED, E.RECLAIM_DIRTY): S.SCRUBBING,
    (S.EXPIRED, E.REVOKE): S.REVOKING,
    (S.REVOKING, E.RECLAIM): S.RECLAIMED,
    (S.REVOKING, E.RECLAIM_DIRTY): S.SCRUBBING,
    (S.SCRUBBING, E.SCRUBBED): S.RECLAIMED,
    (S.SCRUBBING, E.SCRUB_FAILED): S.RECLAIMED,
    # DESIGN.md "Memory follows the pages": ended memfd leases still mapped stay counted.
    (S.GRANTED, E.RELEASE_MAPPED): S.RELEASED_MAPPED,
    (S.ACTIVE, E.RELEASE_MAPPED): S.RELEASED_MAPPED,
    (S.ORPHANED, E.RECLAIM_MAPPED): S.REVOKED_MAPPED,
    (S.EXPIRED, E.RECLAIM_MAPPED): S.REVOKED_MAPPED,
    (S.REVOKING, E.RECLAIM_MAPPED): S.REVOKED_MAPPED,
    (S.REVOKED_MAPPED, E.RECLAIM_MAPPED): S.REVOKED_MAPPED,
    (S.RELEASED_MAPPED, E.UNMAPPED): S.RELEASED,
    (S.REVOKED_MAPPED, E.UNMAPPED): S.RECLAIMED,
}
# Operations a lease holder (through its agent) asks for: refused as lease_not_active.
HOLDER_EVENTS = {E.ACTIVATE, E.RENEW, E.RELEASE, E.RELEASE_DIRTY, E.RELEASE_MAPPED}

ALL_PAIRS = list(itertools.product(LeaseState, LeaseEvent))
FORBIDDEN = [pair for pair in ALL_PAIRS if pair not in ALLOWED]


def test_table_is_exactly_the_design() -> None:
    assert TRANSITIONS == ALLOWED


@pytest.mark.parametrize(("state", "event"), list(ALLOWED), ids=lambda v: str(v))
def test_allowed(state: LeaseState, event: LeaseEvent) -> None:
    assert next_state(state, event) is ALLOWED[(state, event)]


@pytest.mark.parametrize(("state", "event"), FORBIDDEN, ids=lambda v: str(v))
def test_forbidden(state: LeaseState, event: LeaseEvent) -> None:
    expected = LeaseNotActive if event in HOLDER_EVENTS else InvalidTransition
    with pytest.raises(PoolError) as info:
        next_state(state, event)
    assert type(info.value) is expected
    assert info.value.code == expected.code
    assert info.value.detail == {"state": state.value}
    assert info.value.http_status == 409


def test_codes_are_the_stable_ones() -> None:
    assert LeaseNotActive.code == "lease_not_active"
    assert InvalidTransition.code == "invalid_transition"


def test_live_and_terminal_partition_all_states() -> None:
    assert set(LeaseState) == LIVE_STATES | TERMINAL_STATES
    assert not LIVE_STATES & TERMINAL_STATES


def test_held_states_are_live() -> None:
    assert HELD_STATES <= LIVE_STATES


def test_terminal_states_have_no_way_out() -> None:
    for state, event in ALL_PAIRS:
        if state in TERMINAL_STATES:
            assert (state, event) not in TRANSITIONS


def test_every_live_state_can_end() -> None:
    """No live lease is stuck: from each, some path reaches a terminal state."""
    reach = {s: {t for (f, _), t in TRANSITIONS.items() if f is s} for s in LeaseState}
    for start in LIVE_STATES:
        seen, todo = {start}, [start]
        while todo:
            for nxt in reach[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert seen & TERMINAL_STATES, start


def test_database_live_states_match() -> None:
    """The exclusion constraint's WHERE clause must name the same live states."""
    sql_states = {s.strip(" '") for s in LIVE_STATES_SQL.strip("()").split(",")}
    assert sql_states == {s.value for s in LIVE_STATES}
