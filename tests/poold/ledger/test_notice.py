"""poold refuses revocation deadlines shorter than it can deliver a revocation in."""

from __future__ import annotations

import pytest

from poold.errors import DeadlineTooShort
from poold.ledger import admin_ops, lease_views, leases
from poold.ledger.db import Ledger
from poold.wire.agent import GrantRequest
from poold.wire.common import LeaseOut
from tests.poold.conftest import UID, MiB, seed, snapshot


def grant(ledger: Ledger) -> LeaseOut:
    return leases.grant(
        ledger,
        "h1",
        GrantRequest(tenant="t1", size_bytes=4 * MiB, uid=UID, pid=42, activate=True),
        "agent:h1",
    )


@pytest.mark.parametrize("deadline_s", [0.1, 1.0, admin_ops.MIN_NOTICE_S - 0.01])
def test_a_deadline_under_the_notice_is_refused_and_changes_nothing(
    ledger: Ledger, deadline_s: float
) -> None:
    seed(ledger)
    lease = grant(ledger)
    before = snapshot(ledger)
    with pytest.raises(DeadlineTooShort) as err:
        admin_ops.revoke_lease(ledger, lease.id, "test", "admin", deadline_s=deadline_s)
    assert err.value.detail["min_deadline_s"] == admin_ops.MIN_NOTICE_S
    assert snapshot(ledger) == before


@pytest.mark.parametrize("deadline_s", [0.0, admin_ops.MIN_NOTICE_S, 30.0])
def test_now_or_enough_notice_is_taken(ledger: Ledger, deadline_s: float) -> None:
    seed(ledger)
    lease = grant(ledger)
    admin_ops.revoke_lease(ledger, lease.id, "test", "admin", deadline_s=deadline_s)
    assert lease_views.show(ledger, lease.id).state == "revoking"
