"""delegated capacity: reservations, budgets, and where a lease was granted

`reservations` are device extents reserved for one host, whose agent grants leases
inside them alone; `budgets` are a tenant's per-host slices of its quota;
`leases.reservation_id` says which reservation a lease was granted in (NULL: by poold,
centrally, as every lease before this revision). On PostgreSQL an exclusion constraint
keeps reservations of a device from overlapping each other.

Down: the tables go (their unleased bytes are free again, as the older code knows no
delegation); local leases stay as ordinary leases of their host.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-12 00:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reservations",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("offset_bytes", sa.BigInteger(), nullable=False),
        sa.Column("length_bytes", sa.BigInteger(), nullable=False),
        sa.Column("epoch_base", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("length_bytes > 0", name="ck_reservations_length"),
        sa.CheckConstraint("offset_bytes >= 0", name="ck_reservations_offset"),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name="fk_reservations_device_id_devices",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name="fk_reservations_host_id_hosts", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_reservations"),
    )
    op.create_index("ix_reservations_host_id", "reservations", ["host_id"])
    op.create_index("ix_reservations_device_id", "reservations", ["device_id"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE EXTENSION IF NOT EXISTS btree_gist")
        op.execute(
            "ALTER TABLE reservations ADD CONSTRAINT ex_reservations_no_overlap "
            "EXCLUDE USING gist (device_id WITH =, "
            "int8range(offset_bytes, offset_bytes + length_bytes) WITH &&)"
        )
    op.create_table(
        "budgets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("leases", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("bytes >= 0", name="ck_budgets_bytes"),
        sa.CheckConstraint("leases >= 0", name="ck_budgets_leases"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_budgets_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name="fk_budgets_host_id_hosts", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_budgets"),
        sa.UniqueConstraint("tenant_id", "host_id", name="uq_budgets_tenant_host"),
    )
    op.create_index("ix_budgets_host_id", "budgets", ["host_id"])
    # recreate="never": plain ALTER TABLE ADD COLUMN on SQLite (see 0002, 0004).
    with op.batch_alter_table("leases", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("reservation_id", sa.String(length=36), nullable=True))
    op.create_index("ix_leases_reservation_id", "leases", ["reservation_id"])


def downgrade() -> None:
    op.drop_index("ix_leases_reservation_id", table_name="leases")
    with op.batch_alter_table("leases", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("reservation_id")
    op.drop_index("ix_budgets_host_id", table_name="budgets")
    op.drop_table("budgets")
    op.drop_index("ix_reservations_device_id", table_name="reservations")
    op.drop_index("ix_reservations_host_id", table_name="reservations")
    op.drop_table("reservations")
