"""remembered agent request ids (idempotent grants and op batches); hosts get a generation

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 00:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "agent_requests",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["host_id"],
            ["hosts.id"],
            name="fk_agent_requests_host_id_hosts",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_agent_requests"),
        sa.UniqueConstraint("host_id", "request_id", name="uq_agent_requests_host_request"),
    )
    op.create_index("ix_agent_requests_created_at", "agent_requests", ["created_at"])
    # recreate="never": plain ALTER TABLE ADD COLUMN on SQLite; a batch rebuild of
    # hosts would cascade-delete device_paths (see 0002, 0004).
    with op.batch_alter_table("hosts", schema=None, recreate="never") as batch_op:
        batch_op.add_column(
            sa.Column("generation", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("generation")
    op.drop_index("ix_agent_requests_created_at", table_name="agent_requests")
    op.drop_table("agent_requests")
