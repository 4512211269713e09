"""live lease states released_mapped and revoked_mapped (memory follows the pages)

A memfd lease that ends while some process still maps or holds its memfd stays live
(its bytes count against the tenant and the device) until the agent sees none does.
`leases.state` is a plain string, so only PostgreSQL's exclusion constraint, whose
WHERE lists the live states, changes: without the new states in it, a lease placed
over a still-mapped range would not be refused by the database.

Down: released_mapped leases become released (ended now) and revoked_mapped ones
revoking with a deadline of now, which the older reaper reclaims: the older code has
no way to keep counting them.

Revision ID: 0009
Revises: 0007
Create Date: 2026-12-10 00:00:00.000000
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0007"
branch_labels = None
depends_on = None

OLD_LIVE = "'granted','active','expired','orphaned','revoking','scrubbing'"
NEW_LIVE = OLD_LIVE + ",'released_mapped','revoked_mapped'"


def _exclusion(states: str) -> None:
    op.execute("ALTER TABLE leases DROP CONSTRAINT IF EXISTS ex_leases_no_overlap")
    op.execute(
        "ALTER TABLE leases ADD CONSTRAINT ex_leases_no_overlap EXCLUDE USING gist "
        "(device_id WITH =, int8range(offset_bytes, offset_bytes + length_bytes) WITH &&) "
        f"WHERE (state IN ({states}))"
    )


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _exclusion(NEW_LIVE)


def downgrade() -> None:
    now = datetime.now(UTC)
    op.execute(
        sa.text(
            "UPDATE leases SET state = 'released', ended_at = :now WHERE state = 'released_mapped'"
        ).bindparams(now=now)
    )
    op.execute(
        sa.text(
            "UPDATE leases SET state = 'revoking', expires_at = :now WHERE state = 'revoked_mapped'"
        ).bindparams(now=now)
    )
    if op.get_bind().dialect.name == "postgresql":
        _exclusion(OLD_LIVE)
