"""Alembic migrations on each real backend: the schema equals the models, reruns are no-ops,
and servers starting together on a fresh database do not trip over each other."""

from __future__ import annotations

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
