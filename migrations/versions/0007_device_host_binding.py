"""devices are bound to the hosts that may report them (device_hosts)

Every existing device_paths row becomes a binding, so each host keeps reporting
(and placing on) the devices it reached before the upgrade.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-08 00:00:00.000000
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "device_hosts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name="fk_device_hosts_device_id_devices",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["host_id"],
            ["hosts.id"],
            name="fk_device_hosts_host_id_hosts",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_device_hosts"),
        sa.UniqueConstraint("device_id", "host_id", name="uq_device_hosts_device_host"),
    )
    op.create_index("ix_device_hosts_host_id", "device_hosts", ["host_id"])
    # Present or not: a host that reached a device before keeps it when it comes back.
    # device_paths is unique on (device_id, host_id), so no pair is inserted twice.
    # The timestamp is bound through DateTime so SQLite stores the type's text form.
    op.get_bind().execute(
        sa.text(
            "INSERT INTO device_hosts (device_id, host_id, source, created_at) "
            "SELECT device_id, host_id, 'path', :now FROM device_paths"
        ).bindparams(sa.bindparam("now", type_=sa.DateTime(timezone=True))),
        {"now": datetime.now(UTC).replace(tzinfo=None) if _sqlite() else datetime.now(UTC)},
    )


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def downgrade() -> None:
    op.drop_index("ix_device_hosts_host_id", table_name="device_hosts")
    op.drop_table("device_hosts")
