"""Dashboard database URLs, SQLite engine settings and Alembic migrations (real SQLite).

The same migration check runs against PostgreSQL in tests/dashboard/test_migrations.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("alembic")

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from rootstock.dashboard.db import (
    DashboardDatabaseError,
    begin_write,
    database_url,
    make_engine,
    make_sessionmaker,
    migrate,
)
from rootstock.dashboard.models import Base


def test_bare_path_is_an_absolute_sqlite_file(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert database_url("dash.db") == f"sqlite:///{tmp_path / 'dash.db'}"
    assert database_url(str(tmp_path / "x.sqlite3")) == f"sqlite:///{tmp_path / 'x.sqlite3'}"
    assert database_url("sqlite:///rel.db") == f"sqlite:///{tmp_path / 'rel.db'}"


def test_home_is_expanded(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert database_url("~/d.db") == f"sqlite:///{tmp_path / 'd.db'}"


def test_default_is_under_xdg_data_home(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    expected = f"sqlite:///{tmp_path / 'rootstock' / 'dashboard.sqlite3'}"
    assert database_url(None) == expected
    assert database_url("  ") == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u:p@db:5432/dash", "postgresql+psycopg://u:p@db:5432/dash"),
        ("postgres://u:p@db/dash", "postgresql+psycopg://u:p@db/dash"),
        ("postgresql+psycopg://u@db/dash", "postgresql+psycopg://u@db/dash"),
        ("POSTGRESQL://u@db/dash", "postgresql+psycopg://u@db/dash"),
    ],
)
def test_postgresql_urls_use_psycopg(given: str, expected: str):
    assert database_url(given) == expected


@pytest.mark.parametrize("given", ["mysql://u@db/dash", "oracle://x/y", "://nothing"])
def test_unsupported_urls_are_refused_with_a_hint(given: str):
    with pytest.raises(DashboardDatabaseError) as info:
        database_url(given)
    assert "postgresql://" in str(info.value.hint)


def test_sqlite_engine_settings(tmp_path: Path):
    engine = make_engine(database_url(tmp_path / "sub" / "dir" / "d.db"))
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() >= 10_000
    assert (tmp_path / "sub" / "dir" / "d.db").exists()
    engine.dispose()


def test_migrate_creates_exactly_the_model_tables(tmp_path: Path):
    engine = make_engine(database_url(tmp_path / "d.db"))
    migrate(engine)
    tables = set(inspect(engine).get_table_names()) - {"alembic_version"}
    assert tables == set(Base.metadata.tables)
    for name, table in Base.metadata.tables.items():
        columns = {c["name"] for c in inspect(engine).get_columns(name)}
        assert columns == {c.name for c in table.columns}, name
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
    engine.dispose()


def test_migrating_twice_is_a_no_op(tmp_path: Path):
    engine = make_engine(database_url(tmp_path / "d.db"))
    migrate(engine)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as session:
        session.execute(text("INSERT INTO clusters (name, created_at) VALUES ('a', '2026-01-01')"))
        before = session.execute(text("SELECT version_num FROM alembic_version")).all()
    migrate(engine)
    with sessions() as session:
        assert session.execute(text("SELECT version_num FROM alembic_version")).all() == before
        assert session.execute(text("SELECT name FROM clusters")).scalars().all() == ["a"]
    engine.dispose()


def test_a_file_that_is_not_a_database_is_a_clear_error(tmp_path: Path):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("these are notes, not a database\n" * 100)
    with pytest.raises(DashboardDatabaseError) as info:
        migrate(make_engine(database_url(bogus)))
    assert "notes.txt" in str(info.value)


def test_writers_queue_instead_of_failing(tmp_path: Path):
    """Two write transactions: the second waits for the first's commit, then succeeds."""
    engine = make_engine(database_url(tmp_path / "d.db"))
    migrate(engine)
    sessions = make_sessionmaker(engine)
    first_has_lock = threading.Event()
    order: list[str] = []

    def first() -> None:
        with sessions() as session:
            begin_write(session)
            session.execute(text("INSERT INTO clusters (name, created_at) VALUES ('a', '2026')"))
            first_has_lock.set()
            time.sleep(0.5)  # hold the write lock while the second writer starts
            order.append("first")
            session.commit()

    thread = threading.Thread(target=first)
    thread.start()
    assert first_has_lock.wait(10)
    with sessions() as session:
        begin_write(session)
        order.append("second")
        session.execute(text("INSERT INTO clusters (name, created_at) VALUES ('b', '2026')"))
        session.commit()
    thread.join(10)
    assert order == ["first", "second"]
    with sessions() as session:
        assert sorted(session.execute(text("SELECT name FROM clusters")).scalars()) == ["a", "b"]
    engine.dispose()
