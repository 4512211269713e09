"""initial ledger: hosts, devices, paths, tenants, leases, events, quarantine, audits

Revision ID: 0001
Revises:
Create Date: 2026-11-29 21:41:53.561467
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        # btree_gist lets one GiST exclusion constraint mix '=' on device_id
        # with '&&' on the byte range (ships with Debian's postgresql package).
        op.execute("CREATE EXTENSION IF NOT EXISTS btree_gist")

    op.create_table(
        "audit_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reclaim", sa.Boolean(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("findings", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_runs")),
    )
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("uid", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("media", sa.String(length=32), nullable=False),
        sa.Column("recycled", sa.Boolean(), nullable=False),
        sa.Column("provenance", sa.Text(), nullable=True),
        sa.Column("cost_per_gib_month", sa.Float(), nullable=True),
        sa.Column("capacity_bytes", sa.BigInteger(), nullable=False),
        sa.Column("alignment_bytes", sa.BigInteger(), nullable=False),
        sa.Column("health", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("alignment_bytes > 0", name=op.f("ck_devices_alignment")),
        sa.CheckConstraint("capacity_bytes >= 0", name=op.f("ck_devices_capacity")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_devices")),
        sa.UniqueConstraint("uid", name=op.f("uq_devices_uid")),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("lease_id", sa.String(length=36), nullable=True),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("host_id", sa.Integer(), nullable=True),
        sa.Column("device_id", sa.Integer(), nullable=True),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_lease_id"), ["lease_id"], unique=False)

    op.create_table(
        "hosts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("credential_hash", sa.String(length=64), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("inventory_digest", sa.String(length=64), nullable=True),
        sa.Column("agent_version", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hosts")),
        sa.UniqueConstraint("credential_hash", name=op.f("uq_hosts_credential_hash")),
        sa.UniqueConstraint("name", name=op.f("uq_hosts_name")),
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("quota_bytes", sa.BigInteger(), nullable=False),
        sa.Column("quota_leases", sa.Integer(), nullable=False),
        sa.Column("allowed_media", sa.JSON(), nullable=False),
        sa.Column("allowed_uids", sa.JSON(), nullable=False),
        sa.Column("allowed_gids", sa.JSON(), nullable=False),
        sa.Column("allowed_hosts", sa.JSON(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("quota_bytes >= 0", name=op.f("ck_tenants_quota_bytes")),
        sa.CheckConstraint("quota_leases >= 0", name=op.f("ck_tenants_quota_leases")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "device_paths",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("local_name", sa.String(length=64), nullable=False),
        sa.Column("numa_node", sa.Integer(), nullable=True),
        sa.Column("read_latency_ns", sa.Integer(), nullable=True),
        sa.Column("write_latency_ns", sa.Integer(), nullable=True),
        sa.Column("read_bandwidth_mbps", sa.Integer(), nullable=True),
        sa.Column("write_bandwidth_mbps", sa.Integer(), nullable=True),
        sa.Column("distance", sa.Integer(), nullable=True),
        sa.Column("present", sa.Boolean(), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_device_paths_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["host_id"],
            ["hosts.id"],
            name=op.f("fk_device_paths_host_id_hosts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_device_paths")),
        sa.UniqueConstraint("device_id", "host_id", name="uq_device_paths_device_host"),
    )
    with op.batch_alter_table("device_paths", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_device_paths_host_id"), ["host_id"], unique=False)

    op.create_table(
        "leases",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("offset_bytes", sa.BigInteger(), nullable=False),
        sa.Column("length_bytes", sa.BigInteger(), nullable=False),
        sa.Column("requested_bytes", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("ttl_s", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("granted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("activated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("holder_uid", sa.Integer(), nullable=True),
        sa.Column("holder_gid", sa.Integer(), nullable=True),
        sa.Column("holder_pid", sa.Integer(), nullable=True),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("exclusive_bytes", sa.BigInteger(), nullable=False),
        sa.Column("replica_bytes", sa.BigInteger(), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("length_bytes > 0", name=op.f("ck_leases_length")),
        sa.CheckConstraint("offset_bytes >= 0", name=op.f("ck_leases_offset")),
        sa.ForeignKeyConstraint(
            ["device_id"], ["devices.id"], name=op.f("fk_leases_device_id_devices")
        ),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"], name=op.f("fk_leases_host_id_hosts")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_leases_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index("ix_leases_device_state", ["device_id", "state"], unique=False)
        batch_op.create_index("ix_leases_host_state", ["host_id", "state"], unique=False)
        batch_op.create_index("ix_leases_tenant_state", ["tenant_id", "state"], unique=False)

    if bind.dialect.name == "postgresql":
        # No two live leases on a device may overlap, whatever the caller does.
        op.execute(
            "ALTER TABLE leases ADD CONSTRAINT ex_leases_no_overlap EXCLUDE USING gist "
            "(device_id WITH =, int8range(offset_bytes, offset_bytes + length_bytes) WITH &&) "
            "WHERE (state IN ('granted','active','expired','orphaned','revoking','scrubbing'))"
        )

    op.create_table(
        "quarantine",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("offset_bytes", sa.BigInteger(), nullable=False),
        sa.Column("length_bytes", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_quarantine_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quarantine")),
    )
    with op.batch_alter_table("quarantine", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_quarantine_device_id"), ["device_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("quarantine", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_quarantine_device_id"))

    op.drop_table("quarantine")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index("ix_leases_tenant_state")
        batch_op.drop_index("ix_leases_host_state")
        batch_op.drop_index("ix_leases_device_state")

    op.drop_table("leases")
    with op.batch_alter_table("device_paths", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_device_paths_host_id"))

    op.drop_table("device_paths")
    op.drop_table("tenants")
    op.drop_table("hosts")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_lease_id"))

    op.drop_table("events")
    op.drop_table("devices")
    op.drop_table("audit_runs")
