"""Verification history keeps each result's physics checks.

A verification record now carries ``checks`` (forces and stress against the
energy: ratios, modes, tolerances; docs/manifest.md). The cluster page shows the
ratios, so each stored event keeps them as compact JSON text. Events stored
before this revision have none (null).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the nullable ``verification_events.checks`` column (no table rewrite)."""
    op.add_column("verification_events", sa.Column("checks", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop the column again (SQLite rebuilds the table in batch mode)."""
    with op.batch_alter_table("verification_events") as batch:
        batch.drop_column("checks")
