"""The initial dashboard tables (those of ``rootstock.dashboard.models``).

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

NAME = 200
TIME = 40


def _cluster_fk(primary_key: bool = False) -> sa.Column:
    return sa.Column(
        "cluster_id",
        sa.Integer(),
        sa.ForeignKey("clusters.id", ondelete="CASCADE"),
        nullable=False,
        primary_key=primary_key,
    )


def upgrade() -> None:
    """Create every table of the first schema."""
    # Times the server makes are naive UTC DATETIME/TIMESTAMP columns; the model's
    # UTCDateTime adds the zone back on read.
    op.create_table(
        "clusters",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_push_id", sa.Integer(), nullable=True),
        sa.Column("last_push_at", sa.DateTime(), nullable=True),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("key_id", sa.String(64), nullable=False, unique=True),
        sa.Column("secret_hash", sa.String(200), nullable=False),
        sa.Column("maintainer", sa.String(254), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
    )
    op.create_table(
        "api_key_clusters",
        sa.Column(
            "api_key_id",
            sa.Integer(),
            sa.ForeignKey("api_keys.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        _cluster_fk(primary_key=True),
    )
    op.create_table(
        "manifest_pushes",
        sa.Column("id", sa.Integer(), primary_key=True),
        _cluster_fk(),
        sa.Column(
            "api_key_id",
            sa.Integer(),
            sa.ForeignKey("api_keys.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("env_count", sa.Integer(), nullable=False),
        sa.Column("checkpoint_count", sa.Integer(), nullable=False),
        sa.Column("handling_ms", sa.Float(), nullable=True),
        sa.Column("body", sa.Text(), nullable=False),
    )
    op.create_index(
        "ix_manifest_pushes_cluster_received", "manifest_pushes", ["cluster_id", "received_at"]
    )
    op.create_table(
        "cluster_envs",
        _cluster_fk(primary_key=True),
        sa.Column("name", sa.String(NAME), primary_key=True),
        sa.Column("build_id", sa.String(NAME), nullable=True),
        sa.Column("source_hash", sa.String(NAME), nullable=True),
        sa.Column("built_at", sa.String(TIME), nullable=True),
        sa.Column("python", sa.String(NAME), nullable=True),
        sa.Column("torch", sa.String(NAME), nullable=True),
        sa.Column("rootstock", sa.String(NAME), nullable=True),
        sa.Column("push_id", sa.Integer(), nullable=False),
    )
    op.create_table(
        "coverage_cells",
        _cluster_fk(primary_key=True),
        sa.Column("env", sa.String(NAME), primary_key=True),
        sa.Column("checkpoint", sa.String(NAME), primary_key=True),
        sa.Column("family", sa.String(NAME), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("verified_at", sa.String(TIME), nullable=True),
        sa.Column("fetched_at", sa.String(TIME), nullable=True),
        sa.Column("device_kind", sa.String(20), nullable=True),
        sa.Column("device", sa.String(NAME), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("push_id", sa.Integer(), nullable=False),
    )
    op.create_index("ix_coverage_cells_family", "coverage_cells", ["family", "checkpoint"])
    op.create_table(
        "verification_events",
        sa.Column("id", sa.Integer(), primary_key=True),
        _cluster_fk(),
        sa.Column("env", sa.String(NAME), nullable=False),
        sa.Column("checkpoint", sa.String(NAME), nullable=False),
        sa.Column("device_kind", sa.String(20), nullable=False),
        sa.Column("at", sa.String(TIME), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("device", sa.String(NAME), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("energy_per_atom", sa.Float(), nullable=True),
        sa.Column("push_id", sa.Integer(), nullable=False),
        sa.UniqueConstraint(
            "cluster_id", "env", "checkpoint", "device_kind", "at", name="uq_verification_event"
        ),
    )
    op.create_index(
        "ix_verification_events_lookup", "verification_events", ["cluster_id", "checkpoint", "at"]
    )
    op.create_table(
        "usage_counts",
        _cluster_fk(primary_key=True),
        sa.Column("month", sa.String(7), primary_key=True),
        sa.Column("env", sa.String(NAME), primary_key=True),
        sa.Column("checkpoint", sa.String(NAME), primary_key=True),
        sa.Column("sessions", sa.Integer(), nullable=False),
        sa.Column("distinct_users", sa.Integer(), nullable=False),
        sa.Column("force_calls", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    """Drop every table (children first)."""
    for table in (
        "usage_counts",
        "verification_events",
        "coverage_cells",
        "cluster_envs",
        "manifest_pushes",
        "api_key_clusters",
        "api_keys",
        "clusters",
    ):
        op.drop_table(table)
