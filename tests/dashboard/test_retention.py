"""History retention: only each cluster's newest manifest bodies are kept.

Against real servers on real SQLite and PostgreSQL databases. Older history rows
keep their metadata (time, counts) and lose only their body, in the push's own
transaction, so concurrent pushes (from one server or two) keep exactly N.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import select, text

from rootstock.dashboard.models import Cluster, ManifestPush
from rootstock.dashboard.retention import (
    DEFAULT_KEEP_BODIES,
    KEEP_BODIES_ENV,
    MAX_KEEP_BODIES,
)
from tests.dashboard import manifests
from tests.dashboard.conftest import bearer, unique

pytestmark = pytest.mark.timeout(300)


def tiny(cluster: str, n: int) -> dict:
    """A one-checkpoint manifest whose verification time tells push ``n`` apart."""
    at = f"2026-11-28T{n // 60:02d}:{n % 60:02d}:00+00:00"
    return manifests.manifest(
        cluster, {"emt": {"emt": {"cpu": manifests.record("emt", at=at, kind="cpu")}}}
    )


def push_all(
    dashboard, cluster: str, auth: dict[str, str], count: int, start: int = 0
) -> list[int]:
    """PUT ``count`` tiny manifests in order; returns their push ids."""
    ids = []
    with httpx.Client(timeout=60) as client:
        for n in range(start, start + count):
            response = client.put(
                f"{dashboard.url}api/v1/clusters/{cluster}/manifest",
                json=tiny(cluster, n),
                headers=auth,
            )
            assert response.status_code == 200, response.text
            ids.append(response.json()["push_id"])
    return ids


def stored(dashboard, cluster: str) -> dict[int, str | None]:
    """Push id -> stored body (None when dropped) for ``cluster``, read from the database."""
    with dashboard._sessions() as session:
        cluster_id = session.scalars(select(Cluster.id).where(Cluster.name == cluster)).one()
        rows = session.execute(
            select(ManifestPush.id, ManifestPush.body).where(ManifestPush.cluster_id == cluster_id)
        )
        return {push_id: body for push_id, body in rows}


def test_default_keeps_the_newest_100_bodies_and_all_history(live_dashboard):
    assert DEFAULT_KEEP_BODIES == 100
    cluster, auth = live_dashboard.cluster_with_key("keep")
    ids = push_all(live_dashboard, cluster, auth, 105)

    bodies = stored(live_dashboard, cluster)
    assert sorted(bodies) == sorted(ids)
    kept = sorted(i for i, body in bodies.items() if body is not None)
    assert kept == sorted(ids)[-100:]  # the newest 100, by push order
    # A kept body is the manifest as sent.
    newest = ids[-1]
    assert json.loads(bodies[newest]) == tiny(cluster, 104)

    # The history API still lists every push, newest first, bodies or not.
    history = httpx.get(
        f"{live_dashboard.url}api/v1/clusters/{cluster}/pushes", params={"limit": 1000}
    ).json()
    assert [p["push_id"] for p in history["pushes"]] == ids[::-1]
    assert all(p["envs"] == 1 and p["checkpoints"] == 1 for p in history["pushes"])
    latest = httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/manifest").json()
    assert latest["push_id"] == newest and latest["manifest"] == tiny(cluster, 104)
    page = httpx.get(f"{live_dashboard.url}clusters/{cluster}")
    assert page.status_code == 200


def test_configured_keep_bodies_holds_under_concurrent_pushes_from_two_servers(
    dashboard_backend, new_database, start_dashboard, monkeypatch
):
    """$ROOTSTOCK_DASHBOARD_KEEP_BODIES=3: two servers on one database, 24 pushes at once."""
    monkeypatch.setenv(KEEP_BODIES_ENV, "3")
    first = start_dashboard(new_database(dashboard_backend))
    second = start_dashboard(first.db_url)
    cluster = first.add_cluster(unique("conc"))
    auth = bearer(*first.issue_key(cluster))

    sequential = push_all(first, cluster, auth, 5)
    assert sorted(i for i, b in stored(first, cluster).items() if b) == sequential[-3:]

    def push(n: int) -> int:
        server = (first, second)[n % 2]
        response = httpx.put(
            f"{server.url}api/v1/clusters/{cluster}/manifest",
            json=tiny(cluster, 100 + n),
            headers=auth,
            timeout=120,
        )
        assert response.status_code == 200, response.text
        return response.json()["push_id"]

    with ThreadPoolExecutor(max_workers=12) as pool:
        concurrent = list(pool.map(push, range(24)))
    bodies = stored(first, cluster)
    assert len(bodies) == 29
    everything = sorted([*sequential, *concurrent])
    assert sorted(i for i, b in bodies.items() if b is not None) == everything[-3:]
    latest = httpx.get(f"{second.url}api/v1/clusters/{cluster}/manifest").json()
    assert latest["push_id"] == everything[-1]
    assert json.loads(bodies[everything[-1]]) == latest["manifest"]


def test_lowering_the_limit_drops_the_excess_at_the_next_push(dashboard_backend, new_database):
    from rootstock.dashboard import credentials
    from rootstock.dashboard.db import (
        begin_write,
        database_url,
        make_engine,
        make_sessionmaker,
        migrate,
    )
    from rootstock.dashboard.ingest import store_push

    engine = make_engine(database_url(new_database(dashboard_backend)))
    try:
        migrate(engine)
        sessions = make_sessionmaker(engine)

        def push(n: int, keep: int) -> int:
            with sessions() as session:
                begin_write(session)
                cluster = session.scalars(select(Cluster).where(Cluster.name == "alpha")).one()
                pushed = store_push(session, cluster, tiny("alpha", n), None, keep_bodies=keep)
                session.commit()
                return pushed.id

        with sessions() as session:
            credentials.add_cluster(session, "alpha")
            session.commit()
        ids = [push(n, keep=10) for n in range(6)]
        ids.append(push(6, keep=2))
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT id, body IS NOT NULL FROM manifest_pushes")).all()
        assert {i for i, has_body in rows if has_body} == set(ids[-2:])
        assert {i for i, _ in rows} == set(ids)
        for bad in (0, -1, MAX_KEEP_BODIES + 1):
            with pytest.raises(ValueError, match="keep_bodies"):
                push(7, keep=bad)
    finally:
        engine.dispose()


def test_upgrade_to_0003_makes_body_nullable_and_downgrade_drops_bodiless_rows(
    dashboard_backend, new_database
):
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import inspect

    from rootstock.dashboard.db import MIGRATIONS, database_url, make_engine, migrate

    engine = make_engine(database_url(new_database(dashboard_backend)))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))

    def to(revision: str, how=command.upgrade) -> None:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            how(config, revision)

    def body_nullable() -> bool:
        columns = inspect(engine).get_columns("manifest_pushes")
        return next(c for c in columns if c["name"] == "body")["nullable"]

    try:
        to("0002")
        assert not body_nullable()
        migrate(engine)
        assert body_nullable()
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO clusters (name, created_at) VALUES ('old', :t)"),
                         {"t": "2026-11-28 10:00:00"})  # fmt: skip
            cluster_id = conn.execute(text("SELECT id FROM clusters")).scalar()
            for body in ("{}", None):
                conn.execute(
                    text(
                        "INSERT INTO manifest_pushes (cluster_id, received_at, schema_version,"
                        " env_count, checkpoint_count, body) VALUES (:c, :t, 1, 0, 0, :b)"
                    ),
                    {"c": cluster_id, "t": "2026-11-28 10:00:00", "b": body},
                )
        to("0002", command.downgrade)
        assert not body_nullable()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT body FROM manifest_pushes")).scalars().all() == ["{}"]
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--keep-bodies", "0"], {}),
        (["--keep-bodies", "-5"], {}),
        (["--keep-bodies", str(MAX_KEEP_BODIES + 1)], {}),
        (["--keep-bodies", "ten"], {}),
        ([], {KEEP_BODIES_ENV: "0"}),
    ],
)
def test_serve_refuses_a_keep_bodies_out_of_range(tmp_path, args, env):
    from rootstock.cli.main import cli

    db = tmp_path / "d.sqlite3"
    result = CliRunner().invoke(
        cli, ["dashboard", "serve", "--db", str(db), "--port", "0", *args], env=env
    )
    assert result.exit_code == 2, result.output
    assert "--keep-bodies" in result.output
    assert f"1 to {MAX_KEEP_BODIES}" in result.output or "whole number" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not db.exists()  # refused before the database was touched
