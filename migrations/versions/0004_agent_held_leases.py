"""agent-reported leases: which lease ids each agent holds memory for, and when it said so

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 23:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # recreate="never": plain ALTER TABLE ADD COLUMN on SQLite; a batch rebuild of
    # hosts would cascade-delete device_paths (see 0002).
    with op.batch_alter_table("hosts", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("agent_leases", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("agent_leases_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("agent_leases_at")
        batch_op.drop_column("agent_leases")
