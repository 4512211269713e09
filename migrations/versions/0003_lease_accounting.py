"""lease accounting: used bytes and exclusive/replica block counts last reported

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-09 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Existing leases never reported: zero. Plain strings, not sa.text(), as in 0002.
ZERO = "0"

LEASE_COLUMNS = ("used_bytes", "exclusive_blocks", "replica_blocks")


def upgrade() -> None:
    # recreate="never": plain ALTER TABLE ... ADD/DROP COLUMN on SQLite (3.35+); a batch
    # rebuild would DROP TABLE leases, and the PostgreSQL exclusion constraint with it.
    with op.batch_alter_table("leases", schema=None, recreate="never") as batch_op:
        for column in LEASE_COLUMNS:
            batch_op.add_column(
                sa.Column(column, sa.BigInteger(), server_default=ZERO, nullable=False)
            )


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None, recreate="never") as batch_op:
        for column in reversed(LEASE_COLUMNS):
            batch_op.drop_column(column)
