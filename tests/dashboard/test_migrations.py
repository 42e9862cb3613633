"""Alembic migrations on each real backend: the schema equals the models, reruns are no-ops,
and servers starting together on a fresh database do not trip over each other."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from rootstock.dashboard.db import database_url, make_engine, migrate
from rootstock.dashboard.models import Base

pytestmark = pytest.mark.timeout(120)


def test_migrated_schema_is_the_models(dashboard_backend, new_database):
    engine = make_engine(database_url(new_database(dashboard_backend)))
    try:
        migrate(engine)
        migrate(engine)
        assert set(inspect(engine).get_table_names()) == {*Base.metadata.tables, "alembic_version"}
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    finally:
        engine.dispose()


def test_concurrent_migrations_of_a_fresh_database(dashboard_backend, new_database):
    url = database_url(new_database(dashboard_backend))
    engines = [make_engine(url) for _ in range(4)]
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(migrate, engines))  # re-raises the first failure
        with engines[0].connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    finally:
        for engine in engines:
            engine.dispose()


def _upgrade_to(engine, revision: str) -> None:
    """Bring the database to ``revision`` (what ``migrate`` does for ``head``)."""
    from alembic import command
    from alembic.config import Config

    from rootstock.dashboard.db import MIGRATIONS

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def test_upgrade_from_0001_keeps_the_history_and_adds_checks(dashboard_backend, new_database):
    from datetime import datetime

    from rootstock.dashboard.db import make_sessionmaker
    from rootstock.dashboard.ingest import store_push
    from rootstock.dashboard.models import Cluster, VerificationEvent
    from tests.dashboard.manifests import checks, manifest, record

    engine = make_engine(database_url(new_database(dashboard_backend)))
    try:
        _upgrade_to(engine, "0001")
        columns = {c["name"] for c in inspect(engine).get_columns("verification_events")}
        assert "checks" not in columns
        now = datetime(2026, 11, 28, 10, 0, 0)  # naive UTC, as 0001's columns hold it
        # No explicit ids: PostgreSQL's sequences would not know about them.
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO clusters (name, created_at) VALUES ('old', :now)"), {"now": now}
            )
            cluster_id = conn.execute(text("SELECT id FROM clusters")).scalar()
            conn.execute(
                text(
                    "INSERT INTO manifest_pushes (cluster_id, received_at, schema_version,"
                    " env_count, checkpoint_count, body) VALUES (:c, :now, 1, 1, 1, '{}')"
                ),
                {"c": cluster_id, "now": now},
            )
            push_id = conn.execute(text("SELECT id FROM manifest_pushes")).scalar()
            conn.execute(
                text(
                    "INSERT INTO verification_events (cluster_id, env, checkpoint, device_kind,"
                    " at, state, device, message, energy_per_atom, push_id) VALUES"
                    " (:c, 'emt', 'emt', 'cpu', '2026-11-28T10:00:00+00:00', 'verified', 'cpu',"
                    " NULL, 0.0833, :p)"
                ),
                {"c": cluster_id, "p": push_id},
            )

        migrate(engine)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0003"
            rows = conn.execute(
                text("SELECT env, state, energy_per_atom, checks FROM verification_events")
            ).all()
        assert [tuple(r) for r in rows] == [("emt", "verified", 0.0833, None)]

        # A push after the upgrade stores its records' checks next to the old history.
        sessions = make_sessionmaker(engine)
        verified = {**record("emt", at="2026-11-29T10:00:00+00:00", kind="cpu"), "checks": checks()}
        with sessions() as session:
            cluster = session.get(Cluster, cluster_id)
            store_push(session, cluster, manifest("old", {"emt": {"emt": {"cpu": verified}}}), None)
            session.commit()
        with sessions() as session:
            events = session.query(VerificationEvent).order_by(VerificationEvent.at).all()
            assert [e.at for e in events] == [
                "2026-11-28T10:00:00+00:00",
                "2026-11-29T10:00:00+00:00",
            ]
            assert events[0].checks is None
            stored = json.loads(events[1].checks)
            assert stored["forces"]["ratio"] == 1.0 and stored["stress"]["ok"] is True
            assert events[1].cluster_id == cluster_id
            assert session.get(Cluster, cluster_id).name == "old"
    finally:
        engine.dispose()


def test_downgrade_to_0001_drops_only_the_checks_column(dashboard_backend, new_database):
    from alembic import command
    from alembic.config import Config

    from rootstock.dashboard.db import MIGRATIONS

    engine = make_engine(database_url(new_database(dashboard_backend)))
    try:
        migrate(engine)
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0001")
        columns = {c["name"] for c in inspect(engine).get_columns("verification_events")}
        assert "checks" not in columns and "energy_per_atom" in columns
        migrate(engine)
        columns = {c["name"] for c in inspect(engine).get_columns("verification_events")}
        assert "checks" in columns
    finally:
        engine.dispose()
