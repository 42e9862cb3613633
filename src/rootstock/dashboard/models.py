"""The dashboard's tables. Alembic migrations (``migrations/versions``) create them.

Times that the server makes (``created_at``, ``received_at``) are timezone-aware
UTC datetimes. Times copied from a pushed manifest (``verified_at``, ``fetched_at``,
``built_at``, an event's ``at``) are ISO-8601 strings normalised to UTC at ingest
(``2026-01-01T05:00:00+00:00``, whatever offset the install wrote), so they sort
by instant as text on every backend.

A push writes one :class:`ManifestPush` (the history, with the body as sent) and
replaces the cluster's current :class:`ClusterEnv` and :class:`CoverageCell` rows;
each distinct verification it carries is kept once in :class:`VerificationEvent`.
Only a cluster's newest pushes keep their body (``--keep-bodies``); older history
rows keep their metadata with ``body`` null.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAME = 200  # the longest env, checkpoint or cluster name stored
TIME = 40  # an ISO-8601 timestamp copied from a manifest
INFO = 500  # a checkpoint's licence, gated URL or citation, as its env file gives it


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite keeps no zone)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


def utc_now() -> datetime:
    """The current time, timezone-aware."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """Declarative base of every dashboard table."""


class Cluster(Base):
    """A machine that pushes manifests (created by ``rootstock dashboard add-cluster``)."""

    __tablename__ = "clusters"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    last_push_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_push_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class ApiKey(Base):
    """An API key: a public id plus a secret of which only a hash is stored."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    key_id: Mapped[str] = mapped_column(String(64), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(200))
    maintainer: Mapped[str] = mapped_column(String(254))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class ApiKeyCluster(Base):
    """The clusters a key may write to."""

    __tablename__ = "api_key_clusters"

    api_key_id: Mapped[int] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True
    )
    cluster_id: Mapped[int] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), primary_key=True
    )


class ManifestPush(Base):
    """One accepted ``PUT .../manifest``, kept as history with its body."""

    __tablename__ = "manifest_pushes"
    __table_args__ = (Index("ix_manifest_pushes_cluster_received", "cluster_id", "received_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    api_key_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_keys.id", ondelete="SET NULL"), nullable=True
    )
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
    schema_version: Mapped[int] = mapped_column(Integer)
    env_count: Mapped[int] = mapped_column(Integer)
    checkpoint_count: Mapped[int] = mapped_column(Integer)
    # Server-side handling time of this push (read, validate, store), in milliseconds.
    handling_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The JSON text as sent; null once the push is older than the newest keep_bodies.
    body: Mapped[str | None] = mapped_column(Text, nullable=True)


class ClusterEnv(Base):
    """An env as the cluster's latest push describes it."""

    __tablename__ = "cluster_envs"

    cluster_id: Mapped[int] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(NAME), primary_key=True)
    build_id: Mapped[str | None] = mapped_column(String(NAME), nullable=True)
    source_hash: Mapped[str | None] = mapped_column(String(NAME), nullable=True)
    built_at: Mapped[str | None] = mapped_column(String(TIME), nullable=True)
    python: Mapped[str | None] = mapped_column(String(NAME), nullable=True)
    torch: Mapped[str | None] = mapped_column(String(NAME), nullable=True)
    rootstock: Mapped[str | None] = mapped_column(String(NAME), nullable=True)
    push_id: Mapped[int] = mapped_column(Integer)


class CoverageCell(Base):
    """The current state of one checkpoint on one cluster (one cell of the matrix)."""

    __tablename__ = "coverage_cells"
    __table_args__ = (Index("ix_coverage_cells_family", "family", "checkpoint"),)

    cluster_id: Mapped[int] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), primary_key=True
    )
    env: Mapped[str] = mapped_column(String(NAME), primary_key=True)
    checkpoint: Mapped[str] = mapped_column(String(NAME), primary_key=True)
    family: Mapped[str] = mapped_column(String(NAME))
    # One of rootstock.install.manifest.DISPLAY_STATES.
    state: Mapped[str] = mapped_column(String(20))
    verified_at: Mapped[str | None] = mapped_column(String(TIME), nullable=True)
    fetched_at: Mapped[str | None] = mapped_column(String(TIME), nullable=True)
    device_kind: Mapped[str | None] = mapped_column(String(20), nullable=True)
    device: Mapped[str | None] = mapped_column(String(NAME), nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    push_id: Mapped[int] = mapped_column(Integer)
    # What the checkpoint is, from the env file's CHECKPOINT_INFO as the push sent it
    # (the checkpoint's ``info``). ``described`` is false when the push sent none (a
    # client from before it, or an env file it could not read): then licence, gated
    # and citation are unknown, not absent. ``gated`` is the URL where access is
    # requested, null when the checkpoint is not gated.
    described: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    licence: Mapped[str | None] = mapped_column(String(INFO), nullable=True)
    gated: Mapped[str | None] = mapped_column(String(INFO), nullable=True)
    citation: Mapped[str | None] = mapped_column(String(INFO), nullable=True)
    # The latest result per device kind, each derived as ``rootstock status`` derives
    # it (so ``stale`` per kind), as compact JSON text: ``{kind: {"state", "at",
    # "device", "message"}}``. Null for cells stored before it (revision 0004).
    devices: Mapped[str | None] = mapped_column(Text, nullable=True)


class VerificationEvent(Base):
    """One verification result, kept once however many pushes repeat it."""

    __tablename__ = "verification_events"
    __table_args__ = (
        UniqueConstraint(
            "cluster_id", "env", "checkpoint", "device_kind", "at", name="uq_verification_event"
        ),
        Index("ix_verification_events_lookup", "cluster_id", "checkpoint", "at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    env: Mapped[str] = mapped_column(String(NAME))
    checkpoint: Mapped[str] = mapped_column(String(NAME))
    device_kind: Mapped[str] = mapped_column(String(20))
    at: Mapped[str] = mapped_column(String(TIME))
    state: Mapped[str] = mapped_column(String(20))
    device: Mapped[str | None] = mapped_column(String(NAME), nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    energy_per_atom: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The record's physics checks (forces and stress against the energy) as compact
    # JSON text, as the manifest carried them; null for records from before them.
    checks: Mapped[str | None] = mapped_column(Text, nullable=True)
    push_id: Mapped[int] = mapped_column(Integer)


class UsageCount(Base):
    """Aggregated monthly usage of one checkpoint on one cluster (no user identities)."""

    __tablename__ = "usage_counts"

    cluster_id: Mapped[int] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), primary_key=True
    )
    month: Mapped[str] = mapped_column(String(7), primary_key=True)
    env: Mapped[str] = mapped_column(String(NAME), primary_key=True)
    checkpoint: Mapped[str] = mapped_column(String(NAME), primary_key=True)
    sessions: Mapped[int] = mapped_column(Integer)
    distinct_users: Mapped[int] = mapped_column(Integer)
    force_calls: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utc_now)
