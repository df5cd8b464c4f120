"""Tenants and expiry: each file and batch belongs to a tenant (a key's digest or a project's
name, never a key); a batch keeps how long its output files live.

Rows made before this revision have no tenant: no key sees them.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("files", "batches"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("tenant", sa.String(96), nullable=True))
            batch.create_index(f"ix_{table}_tenant", ["tenant"])
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("output_expires_s", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("output_expires_s")
    for table in ("files", "batches"):
        with op.batch_alter_table(table) as batch:
            batch.drop_index(f"ix_{table}_tenant")
            batch.drop_column("tenant")
