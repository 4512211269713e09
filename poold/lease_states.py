"""Which lease transitions are allowed? The state machine of DESIGN.md, pure.

Every arrow in the design's lifecycle diagram is one (state, event) entry of
`TRANSITIONS`; anything not in the table is refused with `invalid_transition`
so that a racing or confused caller can never move a lease backwards.
"""

from __future__ import annotations

from enum import StrEnum

from poold.errors import InvalidTransition, LeaseNotActive


class LeaseState(StrEnum):
    GRANTED = "granted"
    ACTIVE = "active"
    EXPIRED = "expired"
    ORPHANED = "orphaned"
    REVOKING = "revoking"
    SCRUBBING = "scrubbing"
    # Ended, but a process still maps or holds the memfd (DESIGN.md "Memory follows the
    # pages"): its bytes count against the tenant and the device until none does.
    RELEASED_MAPPED = "released_mapped"
    REVOKED_MAPPED = "revoked_mapped"
    RELEASED = "released"
    RECLAIMED = "reclaimed"
    ABORTED = "aborted"


class LeaseEvent(StrEnum):
    ACTIVATE = "activate"
    RENEW = "renew"
    RELEASE = "release"  # by the holder; memory needs no scrub (fresh memfd)
    RELEASE_DIRTY = "release_dirty"  # by the holder; the range must be zeroed first
    ABORT = "abort"
    EXPIRE = "expire"
    ORPHAN = "orphan"
    ADOPT = "adopt"  # an orphan's holder came back (agent restart, reconnect)
    REVOKE = "revoke"
    RECLAIM = "reclaim"
    RECLAIM_DIRTY = "reclaim_dirty"
    SCRUBBED = "scrubbed"
    SCRUB_FAILED = "scrub_failed"
    # The holder released, but its memfd is still mapped or held (by it or by any
    # process it passed the fd to): the agent watches the inode.
    RELEASE_MAPPED = "release_mapped"
    # Revoked, orphaned or expired, and reclaimed, but the memfd is still mapped or held.
    RECLAIM_MAPPED = "reclaim_mapped"
    # The agent found no process mapping or holding the memfd any more.
    UNMAPPED = "unmapped"


S, E = LeaseState, LeaseEvent

TRANSITIONS: dict[tuple[LeaseState, LeaseEvent], LeaseState] = {
    (S.GRANTED, E.ACTIVATE): S.ACTIVE,
    (S.GRANTED, E.ABORT): S.ABORTED,
    # A holder may release before the agent's activation reached poold.
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
    # A range that failed to scrub is quarantined by the caller; the lease still ends.
    (S.SCRUBBING, E.SCRUB_FAILED): S.RECLAIMED,
    # Memory follows the pages: a memfd lease that ends while mapped stays counted.
    (S.GRANTED, E.RELEASE_MAPPED): S.RELEASED_MAPPED,
    (S.ACTIVE, E.RELEASE_MAPPED): S.RELEASED_MAPPED,
    (S.ORPHANED, E.RECLAIM_MAPPED): S.REVOKED_MAPPED,
    (S.EXPIRED, E.RECLAIM_MAPPED): S.REVOKED_MAPPED,
    (S.REVOKING, E.RECLAIM_MAPPED): S.REVOKED_MAPPED,
    # The agent's word again, after poold (the reaper) already moved it: nothing changes.
    (S.REVOKED_MAPPED, E.RECLAIM_MAPPED): S.REVOKED_MAPPED,
    (S.RELEASED_MAPPED, E.UNMAPPED): S.RELEASED,
    (S.REVOKED_MAPPED, E.UNMAPPED): S.RECLAIMED,
}

# States whose bytes are still taken on the device (and count against quota
# until the holder is gone or the range is zeroed).
LIVE_STATES: frozenset[LeaseState] = frozenset(
    {
        S.GRANTED,
        S.ACTIVE,
        S.EXPIRED,
        S.ORPHANED,
        S.REVOKING,
        S.SCRUBBING,
        S.RELEASED_MAPPED,
        S.REVOKED_MAPPED,
    }
)
# Live states whose lease is over for its holder, with its memfd still mapped somewhere.
MAPPED_STATES: frozenset[LeaseState] = frozenset({S.RELEASED_MAPPED, S.REVOKED_MAPPED})
MAPPED_STATE_VALUES: tuple[str, ...] = tuple(s.value for s in LeaseState if s in MAPPED_STATES)
# The same, as the plain strings the ledger stores and compares in SQL (a driver may
# bind an Enum by its name, so SQL never sees the enum members themselves).
LIVE_STATE_VALUES: tuple[str, ...] = tuple(s.value for s in LeaseState if s in LIVE_STATES)
LIVE_STATES_SQL = "(" + ",".join(f"'{s}'" for s in LIVE_STATE_VALUES) + ")"
TERMINAL_STATES: frozenset[LeaseState] = frozenset({S.RELEASED, S.RECLAIMED, S.ABORTED})
# States in which the holder may still use the memory and renew it.
HELD_STATES: frozenset[LeaseState] = frozenset({S.GRANTED, S.ACTIVE})


def next_state(state: LeaseState, event: LeaseEvent) -> LeaseState:
    """The state after `event`, or an error with a stable code.

    Holder operations (renew, release) on a lease that is no longer held get
    `lease_not_active`: that is what a tenant renewing after release sees.
    """
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        if event in (E.RENEW, E.RELEASE, E.RELEASE_DIRTY, E.RELEASE_MAPPED, E.ACTIVATE):
            raise LeaseNotActive(
                f"lease is {state.value}; cannot {event.value} it",
                state=state.value,
            ) from None
        raise InvalidTransition(
            f"no transition from {state.value} on {event.value}", state=state.value
        ) from None
