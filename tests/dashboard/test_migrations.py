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

HEAD = "0004"  # the newest revision in rootstock/dashboard/migrations/versions


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
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == HEAD
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


def test_head_is_the_newest_revision():
    from alembic.script import ScriptDirectory

    from rootstock.dashboard.db import MIGRATIONS

    config_script = ScriptDirectory(str(MIGRATIONS))
    assert config_script.get_heads() == [HEAD]


TAMPERED = "weights of uma-s-1p1 changed since add: cache/uma/u.pt sha256 3f2a… ≠ 9b41…"


def test_upgrade_from_0003_keeps_every_row_and_adds_the_catalogue(dashboard_backend, new_database):
    """A database at 0003 with a row in every table, a tampered cell among them, upgraded."""
    from datetime import datetime

    from rootstock.dashboard.catalogue import catalogue
    from rootstock.dashboard.db import make_sessionmaker
    from rootstock.dashboard.ingest import store_push
    from rootstock.dashboard.models import Cluster
    from tests.dashboard.manifests import manifest, record

    engine = make_engine(database_url(new_database(dashboard_backend)))
    try:
        _upgrade_to(engine, "0003")
        columns = {c["name"] for c in inspect(engine).get_columns("coverage_cells")}
        assert not columns & {"described", "licence", "gated", "citation", "devices"}
        now = datetime(2026, 11, 28, 10, 0, 0)  # naive UTC, as the columns hold it
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO clusters (name, created_at) VALUES ('old', :now)"), {"now": now}
            )
            cluster_id = conn.execute(text("SELECT id FROM clusters")).scalar()
            conn.execute(
                text(
                    "INSERT INTO api_keys (key_id, secret_hash, maintainer, created_at)"
                    " VALUES ('rsk_old', 'hash', 'ops@example.org', :now)"
                ),
                {"now": now},
            )
            key_id = conn.execute(text("SELECT id FROM api_keys")).scalar()
            conn.execute(
                text("INSERT INTO api_key_clusters (api_key_id, cluster_id) VALUES (:k, :c)"),
                {"k": key_id, "c": cluster_id},
            )
            conn.execute(
                text(
                    "INSERT INTO manifest_pushes (cluster_id, api_key_id, received_at,"
                    " schema_version, env_count, checkpoint_count, body)"
                    " VALUES (:c, :k, :now, 3, 1, 2, '{}')"
                ),
                {"c": cluster_id, "k": key_id, "now": now},
            )
            push_id = conn.execute(text("SELECT id FROM manifest_pushes")).scalar()
            conn.execute(
                text("UPDATE clusters SET last_push_id = :p, last_push_at = :now"),
                {"p": push_id, "now": now},
            )
            conn.execute(
                text(
                    "INSERT INTO cluster_envs (cluster_id, name, build_id, built_at, python,"
                    " push_id) VALUES (:c, 'uma', 'b1', '2026-11-01T08:00:00+00:00', '3.11', :p)"
                ),
                {"c": cluster_id, "p": push_id},
            )
            for checkpoint, state, message in (
                ("uma-s-1p1", "tampered", TAMPERED),
                ("uma-m-1p1", "verified", None),
            ):
                conn.execute(
                    text(
                        "INSERT INTO coverage_cells (cluster_id, env, checkpoint, family, state,"
                        " verified_at, device_kind, device, message, push_id) VALUES (:c, 'uma',"
                        " :id, 'uma', :state, '2026-11-28T10:00:00+00:00', 'gpu', 'cuda:0',"
                        " :message, :p)"
                    ),
                    {"c": cluster_id, "id": checkpoint, "state": state, "message": message,
                     "p": push_id},
                )  # fmt: skip
                conn.execute(
                    text(
                        "INSERT INTO verification_events (cluster_id, env, checkpoint,"
                        " device_kind, at, state, device, message, push_id, checks) VALUES"
                        " (:c, 'uma', :id, 'gpu', '2026-11-28T10:00:00+00:00', :state,"
                        " 'cuda:0', :message, :p, NULL)"
                    ),
                    {"c": cluster_id, "id": checkpoint, "state": state, "message": message,
                     "p": push_id},
                )  # fmt: skip
            conn.execute(
                text(
                    "INSERT INTO usage_counts (cluster_id, month, env, checkpoint, sessions,"
                    " distinct_users, force_calls, updated_at)"
                    " VALUES (:c, '2026-11', 'uma', 'uma-m-1p1', 12, 3, 4810, :now)"
                ),
                {"c": cluster_id, "now": now},
            )
        tables = [t for t in Base.metadata.sorted_tables]
        with engine.connect() as conn:
            before = {
                t.name: sorted(tuple(r) for r in conn.execute(text(f"SELECT * FROM {t.name}")))
                for t in tables
            }

        migrate(engine)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == HEAD
            new = "described, licence, gated, citation, devices"
            base_columns = {
                name: [c["name"] for c in inspect(conn).get_columns(name)] for name in before
            }
            for table in tables:
                old_columns = [c for c in base_columns[table.name] if c not in new.split(", ")]
                rows = conn.execute(
                    text(f"SELECT {', '.join(old_columns)} FROM {table.name}")
                ).all()
                # Every row intact, column for column (the new columns come last).
                assert sorted(tuple(r) for r in rows) == before[table.name], table.name
            added = conn.execute(
                text(f"SELECT checkpoint, state, message, {new} FROM coverage_cells")
            ).all()
        assert sorted(tuple(r) for r in added) == [
            ("uma-m-1p1", "verified", None, False, None, None, None, None),
            ("uma-s-1p1", "tampered", TAMPERED, False, None, None, None, None),
        ]

        sessions = make_sessionmaker(engine)
        with sessions() as session:
            # The catalogue reads the old cells: unknown info, the cell as its one device.
            entries = {e["checkpoint"]: e for e in catalogue(session)["checkpoints"]}
            assert entries["uma-s-1p1"]["described"] is False
            assert entries["uma-s-1p1"]["clusters"][0]["devices"][0]["state"] == "tampered"
            assert entries["uma-s-1p1"]["clusters"][0]["message"] == TAMPERED
            assert entries["uma-m-1p1"]["verified_on"] == ["old"]

        # A push after the upgrade fills the new columns.
        again = record("uma", "tampered", at="2026-11-29T10:00:00+00:00", message=TAMPERED)
        body = manifest("old", {"uma": {"uma-s-1p1": {"gpu": again}}})
        body["envs"]["uma"]["checkpoints"]["uma-s-1p1"]["info"] = {
            "licence": "LicenseRef-FAIR-Chem",
            "gated": "https://huggingface.co/facebook/UMA",
            "citation": "arXiv:2506.23971",
        }
        with sessions() as session:
            store_push(session, session.get(Cluster, cluster_id), body, key_id)
            session.commit()
        with sessions() as session:
            (entry,) = catalogue(session)["checkpoints"]
        assert entry["described"] is True
        assert (entry["licence"], entry["gated"], entry["citation"]) == (
            "LicenseRef-FAIR-Chem",
            "https://huggingface.co/facebook/UMA",
            "arXiv:2506.23971",
        )
        (device,) = entry["clusters"][0]["devices"]
        assert (device["state"], device["message"]) == ("tampered", TAMPERED)
        with engine.connect() as conn:  # the pre-upgrade history row is still there
            events = conn.execute(text("SELECT count(*) FROM verification_events")).scalar()
        assert events == 3  # two from before, one new
    finally:
        engine.dispose()


def test_downgrade_to_0003_drops_only_the_catalogue_columns(dashboard_backend, new_database):
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
            command.downgrade(config, "0003")
        columns = {c["name"] for c in inspect(engine).get_columns("coverage_cells")}
        assert not columns & {"described", "licence", "gated", "citation", "devices"}
        assert {"state", "message", "push_id"} <= columns
        migrate(engine)
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()
