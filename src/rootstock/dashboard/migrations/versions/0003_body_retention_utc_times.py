"""History bodies may be dropped; stored manifest times are UTC.

Two changes that came together (issue #13):

* ``manifest_pushes.body`` becomes nullable: only a cluster's newest pushes keep
  their body (``rootstock dashboard serve --keep-bodies``, 100 by default); older
  rows keep their time and counts. Existing bodies are left alone here: the next
  push of each cluster drops what is over its limit.
* Times copied from manifests into rows are normalised to UTC at ingest, so rows
  written before are normalised here too: ``cluster_envs.built_at``,
  ``coverage_cells.verified_at`` and ``fetched_at``, ``verification_events.at``.
  Two events that were one instant written with two offsets become one (the one
  already in UTC is kept, else the one stored first). A time that does not parse
  is left as it was.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# The canonical forms (what rootstock writes, and what ingest stores): rows already
# in one of them are not read back at all, which is nearly every row.
CANONICAL = ("____-__-__T__:__:__+00:00", "____-__-__T__:__:__.______+00:00")
# (table, column) of the times copied from manifests, other than events.
PLAIN_TIMES = (
    ("cluster_envs", "built_at"),
    ("coverage_cells", "verified_at"),
    ("coverage_cells", "fetched_at"),
)


def _utc(text: str | None) -> str | None:
    """``text`` as UTC ISO-8601 (a frozen copy of ingest.utc_time); None if unreadable."""
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.astimezone(UTC).isoformat()
    except (ValueError, OverflowError):
        return None


def _not_canonical(column: sa.ColumnElement) -> sa.ColumnElement:
    return sa.and_(column.is_not(None), *(column.not_like(form) for form in CANONICAL))


def upgrade() -> None:
    """Make ``body`` nullable, then normalise the stored times to UTC."""
    with op.batch_alter_table("manifest_pushes") as batch:
        batch.alter_column("body", existing_type=sa.Text(), nullable=True)
    bind = op.get_bind()
    for table_name, column_name in PLAIN_TIMES:
        table = sa.table(table_name, sa.column(column_name, sa.String))
        column = table.c[column_name]
        found = bind.execute(sa.select(column).distinct().where(_not_canonical(column)))
        for (old,) in found.all():
            new = _utc(old)
            if new is not None and new != old:
                bind.execute(table.update().where(column == old).values({column_name: new}))
    _normalise_events(bind)


def _normalise_events(bind: sa.Connection) -> None:
    events = sa.table(
        "verification_events",
        sa.column("id", sa.Integer),
        sa.column("cluster_id", sa.Integer),
        sa.column("env", sa.String),
        sa.column("checkpoint", sa.String),
        sa.column("device_kind", sa.String),
        sa.column("at", sa.String),
    )
    c = events.c
    rows = bind.execute(
        sa.select(c.id, c.cluster_id, c.env, c.checkpoint, c.device_kind, c.at)
        .where(_not_canonical(c.at))
        .order_by(c.id)
    ).all()
    for event_id, cluster_id, env, checkpoint, kind, old in rows:
        new = _utc(old)
        if new is None or new == old:
            continue
        # The unique key (cluster, env, checkpoint, kind, at) may already hold this
        # instant, stored in UTC or by an earlier row of this loop.
        twin = bind.execute(
            sa.select(c.id).where(
                c.cluster_id == cluster_id,
                c.env == env,
                c.checkpoint == checkpoint,
                c.device_kind == kind,
                c.at == new,
            )
        ).first()
        if twin is None:
            bind.execute(events.update().where(c.id == event_id).values(at=new))
        else:
            bind.execute(events.delete().where(c.id == event_id))


def downgrade() -> None:
    """Delete the history rows without a body (0002 requires one), then require it again.

    The times stay in UTC: 0002 reads them just as well.
    """
    pushes = sa.table("manifest_pushes", sa.column("body", sa.Text))
    op.get_bind().execute(pushes.delete().where(pushes.c.body.is_(None)))
    with op.batch_alter_table("manifest_pushes") as batch:
        batch.alter_column("body", existing_type=sa.Text(), nullable=False)
