"""What each checkpoint is, and its state per device kind, on each coverage cell.

Issue #33. The catalogue page (``/catalogue``, ``GET /api/v1/catalogue``) lists every
checkpoint across clusters with its licence, gated status and citation, and where it
is verified, on which devices and when. Pushes now carry each checkpoint's ``info``
(from its env file's ``CHECKPOINT_INFO``), kept on its coverage cell:

* ``described``: whether the push carried ``info`` (false for every existing row, and
  for pushes from older clients, whose licence and gating are unknown);
* ``licence``, ``gated`` (the URL where access is requested) and ``citation``;
* ``devices``: the latest result per device kind as compact JSON text; null for
  existing rows until the cluster's next push.

The new verification state ``tampered`` (a weight file changed since ``add``) needs
no change: states are free ``String(20)`` columns with no CHECK constraint or enum,
on both backends. Only columns are added, so no table is rewritten.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

INFO = 500
NEW_COLUMNS = ("described", "licence", "gated", "citation", "devices")


def upgrade() -> None:
    """Add the nullable info and device columns, and ``described`` (false by default)."""
    op.add_column(
        "coverage_cells",
        sa.Column("described", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    for name in ("licence", "gated", "citation"):
        op.add_column("coverage_cells", sa.Column(name, sa.String(INFO), nullable=True))
    op.add_column("coverage_cells", sa.Column("devices", sa.Text(), nullable=True))


def downgrade() -> None:
    """Drop the columns again (SQLite rebuilds the table in batch mode)."""
    with op.batch_alter_table("coverage_cells") as batch:
        for name in NEW_COLUMNS:
            batch.drop_column(name)
