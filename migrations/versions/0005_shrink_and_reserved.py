"""shrink requests with a deadline on leases; ranges of a device that poold does not own

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 00:20:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # recreate="never": plain ALTER TABLE ADD COLUMN on SQLite (see 0002, 0004).
    with op.batch_alter_table("leases", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("shrink_wanted_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(
            sa.Column("shrink_deadline_at", sa.DateTime(timezone=True), nullable=True)
        )
    op.create_index("ix_leases_shrink_deadline", "leases", ["shrink_deadline_at"])
    with op.batch_alter_table("devices", schema=None, recreate="never") as batch_op:
        batch_op.add_column(
            sa.Column("reserved_extents", sa.JSON(), nullable=False, server_default="[]")
        )


def downgrade() -> None:
    with op.batch_alter_table("devices", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("reserved_extents")
    op.drop_index("ix_leases_shrink_deadline", table_name="leases")
    with op.batch_alter_table("leases", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("shrink_deadline_at")
        batch_op.drop_column("shrink_wanted_bytes")
