"""a tenant's central room: quota its hosts' budgets leave undelegated for a while

`tenants.central_room_bytes` and `central_room_until`: after a central grant was refused
only because the tenant's quota sat in hosts' unspent budgets, that much of the quota
(and one lease) is kept out of budgets until `central_room_until`, so the next such
grant fits (poold/ledger/central_room.py). Existing tenants start with none.

Down: the columns go; budgets are sized from the whole quota again.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-13 00:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None, recreate="never") as batch_op:
        batch_op.add_column(
            sa.Column("central_room_bytes", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("central_room_until", sa.DateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("central_room_until")
        batch_op.drop_column("central_room_bytes")
