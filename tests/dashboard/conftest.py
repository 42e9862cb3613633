"""Fixtures for the dashboard: real servers on loopback over real databases.

* ``dashboard_backend``: "sqlite" or "postgresql" (session-scoped, parametrised);
  PostgreSQL needs ``ROOTSTOCK_TEST_POSTGRES_URL`` (scripts/dev/postgres-up prints
  one) and is skipped without it, except under CI, where a missing server fails.
* ``live_dashboard``: a ``rootstock dashboard serve`` subprocess per backend for the
  whole session, on a fresh database. Tests share it, so each uses its own
  cluster names (:func:`unique`).
* ``sqlite_dashboard``: the SQLite one alone, for tests that need one backend.
* ``start_dashboard(db_url)``: a server of the test's own, killed at teardown.
* ``new_database(backend)``: a fresh, empty database URL (dropped at session end).

Every server runs in its own process group; teardown kills the group.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

POSTGRES_ENV = "ROOTSTOCK_TEST_POSTGRES_URL"
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 10
TEST_MAX_BODY = 1 * 2**20
URL_LINE = re.compile(r"^dashboard: (http://\S+/)$", re.MULTILINE)


def unique(prefix: str = "c") -> str:
    """A cluster name no other test uses (cluster names are lower-case)."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def bearer(key: str, secret: str) -> dict[str, str]:
    """The Authorization header for ``key`` and ``secret``."""
    return {"Authorization": f"Bearer {key}:{secret}"}


class Dashboard:
    """A real ``rootstock dashboard serve`` process and a handle on its database."""

    def __init__(self, db_url: str, log_dir: Path, max_body: int = TEST_MAX_BODY) -> None:
        from rootstock.dashboard.db import database_url, make_engine, make_sessionmaker

        self.db_url = database_url(db_url)
        self.max_body = max_body
        self.log_path = log_dir / f"dashboard-{uuid.uuid4().hex[:8]}.log"
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._engine = make_engine(self.db_url)
        self._sessions = make_sessionmaker(self._engine)

    # --- process ----------------------------------------------------------------------
    def start(self) -> Dashboard:
        """Start the server (on the port it had before, if any) and wait until it answers."""
        command = [
            sys.executable,
            "-m",
            "rootstock.cli.main",
            "dashboard",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-body",
            str(self.max_body),
            "--log-level",
            "warning",
        ]
        log = self.log_path.open("ab")
        offset = self.log_path.stat().st_size
        self.proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # The database by environment, as docs/dashboard.md recommends: a URL with a
            # password on the command line would show in ps.
            env={
                **os.environ,
                "ROOTSTOCK_DASHBOARD_DB": self.db_url,
                "PYTHONFAULTHANDLER": "1",
                "PYTHONUNBUFFERED": "1",
            },
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"dashboard exited with {self.proc.returncode}:\n{self.log_tail()}")
            match = URL_LINE.search(self.log_path.read_bytes()[offset:].decode(errors="replace"))
            if match and self._answers(match.group(1)):
                self.url = match.group(1)
                self.port = int(self.url.rstrip("/").rsplit(":", 1)[1])
                return self
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"dashboard did not answer within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            return httpx.get(f"{url}api/v1/clusters", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGTERM the server's process group; SIGKILL it if it lingers."""
        self._signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL the server's process group at once."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(STOP_TIMEOUT_S)

    def restart(self) -> Dashboard:
        """Stop (if running) and start again on the same port and database."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        return self.start()

    def _signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log (for failure messages)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Kill the server and release the database handle."""
        self.kill()
        self._engine.dispose()

    # --- credentials (written straight to the database, as the CLI does) -------------
    @contextlib.contextmanager
    def _write(self):
        from rootstock.dashboard.db import begin_write

        with self._sessions() as session:
            begin_write(session)
            yield session
            session.commit()

    def add_cluster(self, name: str) -> str:
        """Register cluster ``name``; returns it."""
        from rootstock.dashboard import credentials

        with self._write() as session:
            credentials.add_cluster(session, name)
        return name

    def issue_key(self, *clusters: str, maintainer: str = "ops@example.org") -> tuple[str, str]:
        """A new key scoped to ``clusters``: ``(api_key, api_secret)``."""
        from rootstock.dashboard import credentials

        with self._write() as session:
            issued = credentials.issue_key(session, list(clusters), maintainer)
        return issued.key_id, issued.secret

    def revoke(self, key: str) -> None:
        """Revoke ``key``."""
        from rootstock.dashboard import credentials

        with self._write() as session:
            credentials.revoke_key(session, key)

    def cluster_with_key(self, prefix: str = "c") -> tuple[str, dict[str, str]]:
        """A fresh cluster and the Authorization header of a key scoped to it."""
        name = self.add_cluster(unique(prefix))
        return name, bearer(*self.issue_key(name))


def _postgres_admin_url() -> str:
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        message = f"{POSTGRES_ENV} is not set (scripts/dev/postgres-up prints a URL)"
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL tests must run in CI: {message}")
        pytest.skip(message)
    return url


@pytest.fixture(scope="session")
def new_database(tmp_path_factory) -> Iterator[Callable[[str], str]]:
    """A factory of fresh, empty databases: ``new_database("sqlite" | "postgresql")``."""
    created: list[tuple[str, str]] = []

    def make(backend: str) -> str:
        name = f"rootstock_test_{uuid.uuid4().hex[:12]}"
        if backend == "sqlite":
            return str(tmp_path_factory.mktemp("dashboard-db") / f"{name}.sqlite3")
        if backend != "postgresql":
            raise ValueError(f"unknown backend {backend!r}")
        import psycopg
        from sqlalchemy.engine import make_url

        admin = _postgres_admin_url()
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        created.append((admin, name))
        return make_url(admin).set(database=name).render_as_string(hide_password=False)

    yield make
    import psycopg

    for admin, name in created:
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(
    scope="session", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.system)]
)
def dashboard_backend(request) -> str:
    """The database backend under test."""
    if request.param == "postgresql":
        _postgres_admin_url()
    return request.param


@pytest.fixture(scope="session")
def sqlite_dashboard(new_database, tmp_path_factory) -> Iterator[Dashboard]:
    """A live dashboard on a fresh SQLite database, for the whole session."""
    dashboard = Dashboard(new_database("sqlite"), tmp_path_factory.mktemp("dashboard-logs"))
    try:
        yield dashboard.start()
    finally:
        dashboard.close()


@pytest.fixture(scope="session")
def postgresql_dashboard(new_database, tmp_path_factory) -> Iterator[Dashboard]:
    """A live dashboard on a fresh PostgreSQL database, for the whole session."""
    dashboard = Dashboard(new_database("postgresql"), tmp_path_factory.mktemp("dashboard-logs"))
    try:
        yield dashboard.start()
    finally:
        dashboard.close()


@pytest.fixture(scope="session")
def live_dashboard(request, dashboard_backend: str) -> Dashboard:
    """The session's live dashboard on ``dashboard_backend``."""
    return request.getfixturevalue(f"{dashboard_backend}_dashboard")


@pytest.fixture
def start_dashboard(tmp_path: Path) -> Iterator[Callable[..., Dashboard]]:
    """Start a dashboard of the test's own: ``start_dashboard(db_url, max_body=...)``."""
    started: list[Dashboard] = []

    def start(db_url: str, max_body: int = TEST_MAX_BODY) -> Dashboard:
        dashboard = Dashboard(db_url, tmp_path, max_body=max_body)
        started.append(dashboard)
        return dashboard.start()

    yield start
    for dashboard in started:
        dashboard.close()
