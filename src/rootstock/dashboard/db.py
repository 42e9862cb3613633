"""Database URLs, engines, sessions and migrations of the dashboard.

SQLite is the embedded default (one file, WAL journal); PostgreSQL is the
multi-user path. Every write transaction goes through :func:`begin_write`, which
makes concurrent pushes queue instead of failing: on SQLite it starts the
transaction with ``BEGIN IMMEDIATE`` (the write lock is taken up front, so a
transaction never has to upgrade a stale read snapshot, which SQLite refuses
without waiting); on PostgreSQL the caller locks the cluster row it writes under.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from rootstock.errors import RootstockError

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# How long a SQLite writer waits for the write lock before giving up (milliseconds).
SQLITE_BUSY_TIMEOUT_MS = 30_000
# The execution option that asks for a write transaction (see begin_write).
WRITE_OPTION = "rootstock_write"
# Marks a connection whose transaction holds this process's SQLite writer lock.
_HOLDS_WRITERS = "rootstock_holds_writers"
# Any constant: the PostgreSQL advisory lock that serialises concurrent migrations.
MIGRATION_LOCK_ID = 7_201_177


class DashboardDatabaseError(RootstockError):
    """The dashboard database URL is wrong, or the database cannot be reached."""


def default_database_path() -> Path:
    """``$XDG_DATA_HOME/rootstock/dashboard.sqlite3`` (``~/.local/share`` by default)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "rootstock" / "dashboard.sqlite3"


def database_url(text_: str | None) -> str:
    """The SQLAlchemy URL for ``--db``: a URL, a bare path (a SQLite file), or None.

    ``postgresql://`` and ``postgres://`` select the psycopg 3 driver; a bare path
    is made absolute; None is the default SQLite file.
    """
    if text_ is None or not str(text_).strip():
        return _sqlite_url(default_database_path())
    raw = str(text_).strip()
    if "://" not in raw:
        return _sqlite_url(Path(raw).expanduser())
    scheme, rest = raw.split("://", 1)
    scheme = scheme.lower()
    if scheme in ("postgresql", "postgres"):
        raw = f"postgresql+psycopg://{rest}"
    try:
        url = make_url(raw)
    except ArgumentError:
        raise DashboardDatabaseError(
            f"--db {raw!r} is not a database URL",
            hint="give a file path (SQLite) or postgresql://USER:PASSWORD@HOST:PORT/DBNAME",
        ) from None
    if url.get_backend_name() not in ("sqlite", "postgresql"):
        raise DashboardDatabaseError(
            f"--db uses {url.get_backend_name()!r}; the dashboard supports SQLite and PostgreSQL",
            hint="give a file path (SQLite) or postgresql://USER:PASSWORD@HOST:PORT/DBNAME",
        )
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        return _sqlite_url(Path(url.database).expanduser())
    return url.render_as_string(hide_password=False)


def _sqlite_url(path: Path) -> str:
    return f"sqlite:///{path.absolute()}"


def describe_url(url: str) -> str:
    """``url`` with its password hidden, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<invalid URL>"


def make_engine(url: str) -> Engine:
    """An engine for ``url`` (from :func:`database_url`).

    SQLite gets WAL (readers never block the writer), a busy timeout, foreign keys
    and explicit transaction control; the parent directory of its file is created.
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DashboardDatabaseError(f"{url!r} is not a database URL") from None
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(url, parsed.database)
    try:
        # pool_pre_ping: a server restart between requests costs a reconnect, not a 5xx.
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=30)
    except (NoSuchModuleError, ImportError) as exc:
        raise DashboardDatabaseError(
            f"no database driver for {describe_url(url)}: {exc}",
            hint="pip install 'rootstock[dashboard]' (it brings psycopg)",
        ) from None


def _sqlite_engine(url: str, database: str | None) -> Engine:
    if database and database != ":memory:":
        path = Path(database)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DashboardDatabaseError(
                f"cannot create the directory of the dashboard database {path}: {exc}",
                hint="pass --db with a path you can write",
            ) from None
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        pool_size=20,
        max_overflow=20,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
        # Take transaction control from the driver, so that "begin" below decides
        # between a read (deferred) and a write (immediate) transaction.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        _use_wal(cursor)
        cursor.execute("PRAGMA foreign_keys=ON")
        # WAL with synchronous=NORMAL is still crash-safe (a power cut may lose the
        # last commits, never corrupt the file) and spares an fsync per push.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    # Writers of this process queue on a lock before asking SQLite for its write lock:
    # a writer refused by SQLite polls with growing sleeps (its busy handler), so ten
    # concurrent pushes would wait far longer than the few milliseconds each holds it.
    # BEGIN IMMEDIATE still guards against other processes (the CLI, a second server).
    writers = threading.Lock()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if not conn.get_execution_options().get(WRITE_OPTION, False):
            conn.exec_driver_sql("BEGIN")
            return
        if not writers.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            raise PoolTimeoutError("timed out waiting for the SQLite write lock")
        conn.info[_HOLDS_WRITERS] = True
        try:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            _release(conn.info)
            raise

    def _release(info: dict) -> None:
        if info.pop(_HOLDS_WRITERS, False):
            writers.release()

    # After the transaction ends, however it ends (commit, rollback, or the pool
    # resetting a connection returned mid-transaction).
    event.listen(engine, "commit", lambda conn: _release(conn.info))
    event.listen(engine, "rollback", lambda conn: _release(conn.info))
    event.listen(engine.pool, "checkin", lambda _dbapi, record: _release(record.info))
    return engine


def _use_wal(cursor: sqlite3.Cursor) -> None:
    """Switch the database file to WAL (kept in the file, so once is enough).

    SQLite answers "database is locked" at once, without its busy handler, when two
    connections race to switch a fresh file: retry for up to the busy timeout.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                return
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to ``engine``; objects stay readable after commit."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def begin_write(session: Session) -> None:
    """Start ``session``'s transaction as a write transaction (call it first).

    On SQLite this takes the database's write lock now (waiting up to the busy
    timeout for another writer); elsewhere it is an ordinary transaction.
    """
    session.connection(execution_options={WRITE_OPTION: True})


def migrate(engine: Engine) -> None:
    """Bring the database to the newest schema (Alembic ``upgrade head``).

    Safe to run at every start and from several processes at once: a second run
    is a no-op, and concurrent runs queue on a lock.
    """
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    try:
        with engine.connect() as connection:
            connection = connection.execution_options(**{WRITE_OPTION: True})
            with connection.begin():
                if connection.dialect.name == "postgresql":
                    connection.execute(
                        text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID}
                    )
                config.attributes["connection"] = connection
                command.upgrade(config, "head")
    except SQLAlchemyError as exc:
        raise unreachable(engine, exc) from None


def unreachable(engine: Engine, exc: BaseException) -> DashboardDatabaseError:
    """The error to raise when ``engine``'s database refused or failed an operation."""
    first_line = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    reason = first_line[0] if first_line else type(exc).__name__
    if engine.dialect.name == "sqlite":
        hint = "check --db (or $ROOTSTOCK_DASHBOARD_DB): it must name a SQLite file you can write"
    else:
        hint = (
            "check --db (or $ROOTSTOCK_DASHBOARD_DB): the server must be running and "
            "reachable, the user and password right, and the database created"
        )
    return DashboardDatabaseError(
        f"cannot use the dashboard database {describe_url(str(engine.url))}: {reason}", hint=hint
    )
