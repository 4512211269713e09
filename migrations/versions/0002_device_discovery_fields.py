"""device discovery fields: memdev serials, health reasons, memory tier, admin annotations

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Existing rows get an empty list/object; the server default stays so that the models
# (which declare it too) and the migrated schema agree. Plain strings, not sa.text():
# alembic treats a text() default as an SQL expression and rebuilds the SQLite table.
EMPTY_LIST = "[]"
EMPTY_OBJECT = "{}"

DEVICE_COLUMNS = ("memdev_serials", "health_reasons", "reported_annotations", "admin_annotations")


def upgrade() -> None:
    # recreate="never": on SQLite these are plain ALTER TABLE ... ADD/DROP COLUMN (3.35+).
    # Rebuilding `devices` instead (batch mode's copy-and-rename) would DROP TABLE it with
    # foreign_keys=ON, and ON DELETE CASCADE would empty device_paths and quarantine.
    with op.batch_alter_table("devices", schema=None, recreate="never") as batch_op:
        batch_op.add_column(
            sa.Column("memdev_serials", sa.JSON(), server_default=EMPTY_LIST, nullable=False)
        )
        batch_op.add_column(
            sa.Column("health_reasons", sa.JSON(), server_default=EMPTY_LIST, nullable=False)
        )
        batch_op.add_column(
            sa.Column(
                "reported_annotations", sa.JSON(), server_default=EMPTY_OBJECT, nullable=False
            )
        )
        batch_op.add_column(
            sa.Column("admin_annotations", sa.JSON(), server_default=EMPTY_OBJECT, nullable=False)
        )
    with op.batch_alter_table("device_paths", schema=None, recreate="never") as batch_op:
        batch_op.add_column(sa.Column("memory_tier", sa.Integer(), nullable=True))


def downgrade() -> None:
    # recreate="never" for the reason given in upgrade().
    with op.batch_alter_table("device_paths", schema=None, recreate="never") as batch_op:
        batch_op.drop_column("memory_tier")
    with op.batch_alter_table("devices", schema=None, recreate="never") as batch_op:
        for column in reversed(DEVICE_COLUMNS):
            batch_op.drop_column(column)
