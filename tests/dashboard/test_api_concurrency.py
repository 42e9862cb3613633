"""Concurrent writes and a failing database, against real servers on loopback.

Split from test_api.py: these start extra servers or many clients at once. On
PostgreSQL, several server processes may share one database (each has its own
write slot), so writes to one cluster from two processes must wait for each other
in the database rather than conflict.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import text

from tests.dashboard import manifests
from tests.dashboard.conftest import bearer, unique
from tests.dashboard.test_api import _usage_rows, put_manifest, simple, usage_row

pytestmark = pytest.mark.timeout(300)
LOCK_WAIT_DEADLINE_S = 30


# --- concurrency ----------------------------------------------------------------------------
def test_fifty_concurrent_pushes_from_ten_clusters_are_all_stored(live_dashboard):
    clusters = [live_dashboard.cluster_with_key("conc") for _ in range(10)]
    jobs = [(name, auth, n) for name, auth in clusters for n in range(5)]

    def push(job):
        name, auth, n = job
        at = f"2026-11-28T10:00:{n:02d}+00:00"  # each push carries a new verification
        with httpx.Client(timeout=120) as client:
            return client.put(
                f"{live_dashboard.url}api/v1/clusters/{name}/manifest",
                json=manifests.manifest(
                    name,
                    {
                        f"fam{f}": {
                            f"fam{f}-ck{c}": {"gpu": manifests.record(f"fam{f}", at=at)}
                            for c in range(10)
                        }
                        for f in range(3)
                    },
                ),
                headers=auth,
            )

    with ThreadPoolExecutor(max_workers=50) as pool:
        responses = list(pool.map(push, jobs))
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * 50, [r.text for r in responses if r.status_code != 200][:3]
    assert len({r.json()["push_id"] for r in responses}) == 50
    for name, _ in clusters:
        history = httpx.get(f"{live_dashboard.url}api/v1/clusters/{name}/pushes").json()
        assert len(history["pushes"]) == 5
        latest = httpx.get(f"{live_dashboard.url}api/v1/clusters/{name}/manifest").json()
        assert latest["push_id"] == history["pushes"][0]["push_id"]
    coverage = httpx.get(f"{live_dashboard.url}api/v1/coverage").json()
    for name, _ in clusters:
        cells = [row["cells"][name] for row in coverage["checkpoints"] if name in row["cells"]]
        assert len(cells) == 30
        assert {cell["state"] for cell in cells} == {"verified"}


# --- the database failing under the server -------------------------------------------------
def test_database_failure_is_a_clean_503(dashboard_backend, new_database, start_dashboard):
    """A table gone from under the server (a stand-in for a broken database): JSON 503s."""
    from sqlalchemy import text

    from rootstock.dashboard.db import database_url, make_engine

    server = start_dashboard(new_database(dashboard_backend))
    cluster, auth = server.cluster_with_key()
    engine = make_engine(database_url(server.db_url))
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE coverage_cells"))
    engine.dispose()
    reads = httpx.get(f"{server.url}api/v1/coverage")
    write = put_manifest(server, cluster, simple(cluster), auth)
    for response in (reads, write):
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "5"
        assert "unavailable" in response.json()["detail"]
    # Reads that do not touch the lost table still work.
    assert httpx.get(f"{server.url}api/v1/clusters").status_code == 200


def test_database_failure_while_checking_credentials_is_a_logged_503(
    dashboard_backend, new_database, start_dashboard
):
    """The key's scope table gone (a stand-in for a broken database): 503, and logged."""
    from rootstock.dashboard.db import database_url, make_engine

    server = start_dashboard(new_database(dashboard_backend))
    cluster, auth = server.cluster_with_key()
    engine = make_engine(database_url(server.db_url))
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE api_key_clusters"))
    engine.dispose()
    write = put_manifest(server, cluster, simple(cluster), auth)
    assert write.status_code == 503, write.text
    assert write.headers["retry-after"] == "5"
    assert "database error checking credentials" in server.log_tail()


# --- several server processes on one PostgreSQL database -----------------------------------
@pytest.mark.system
def test_two_servers_on_one_postgresql_database(new_database, start_dashboard):
    """Manifest and usage pushes spread over two processes: all stored, none refused."""
    db_url = new_database("postgresql")
    first = start_dashboard(db_url)
    second = start_dashboard(db_url)
    shared = first.add_cluster(unique("shared"))
    others = [first.add_cluster(unique("other")) for _ in range(3)]
    auth = bearer(*first.issue_key(shared, *others))
    servers = [first, second]

    def push_manifest(job: tuple[int, str]) -> httpx.Response:
        n, cluster = job
        body = manifests.manifest(
            cluster, {"mace": {f"mace-{c}": {"gpu": manifests.record("mace")} for c in range(20)}}
        )
        body["envs"]["mace"]["checkpoints"]["mace-0"]["verifications"][cluster]["gpu"]["at"] = (
            f"2026-11-28T10:{n // 60:02d}:{n % 60:02d}+00:00"
        )
        return put_manifest(servers[n % 2], cluster, body, auth)

    def push_usage(n: int) -> httpx.Response:
        # The same cluster and month each time: every push replaces the month's rows.
        counts = [usage_row(checkpoint=f"mace-{c}", sessions=n) for c in range(20)]
        return httpx.post(
            f"{servers[n % 2].url}api/v1/clusters/{shared}/usage",
            json={"version": 1, "counts": counts},
            headers=auth,
            timeout=60,
        )

    manifest_jobs = [(n, shared) for n in range(12)] + [
        (n, cluster) for cluster in others for n in range(4)
    ]
    with ThreadPoolExecutor(max_workers=16) as pool:
        manifest_futures = [pool.submit(push_manifest, job) for job in manifest_jobs]
        usage_futures = [pool.submit(push_usage, n) for n in range(12)]
        responses = [f.result() for f in manifest_futures + usage_futures]
    refused = [(r.status_code, r.text) for r in responses if r.status_code != 200]
    assert refused == []

    for cluster, expected in [(shared, 12), *((c, 4) for c in others)]:
        history = httpx.get(f"{second.url}api/v1/clusters/{cluster}/pushes").json()
        assert len(history["pushes"]) == expected
    rows = _usage_rows(first, shared)
    assert len(rows) == 20
    # One push's counts won whole: every row carries the same session count.
    assert len({sessions for sessions, _, _ in rows.values()}) == 1


@pytest.mark.system
def test_usage_replaces_of_one_month_wait_for_each_other(new_database):
    """Two transactions replacing one cluster's month (two server processes at once).

    The second must wait for the first and then replace its rows, not insert beside
    them (which the unique index would refuse once the first commits).
    """
    from rootstock.dashboard import credentials, ingest
    from rootstock.dashboard.db import database_url, make_engine, make_sessionmaker, migrate
    from rootstock.dashboard.models import Cluster

    url = database_url(new_database("postgresql"))
    engine = make_engine(url)
    try:
        migrate(engine)
        sessions = make_sessionmaker(engine)
        with sessions() as session:
            credentials.add_cluster(session, "alpha")
            session.commit()
        counts = [usage_row(sessions=1), usage_row(checkpoint="other", sessions=1)]
        errors: list[BaseException] = []

        def second_writer() -> None:
            try:
                with sessions() as session:
                    cluster = session.query(Cluster).filter_by(name="alpha").one()
                    ingest.store_usage(session, cluster, [{**c, "sessions": 2} for c in counts])
                    session.commit()
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        with sessions() as first:
            cluster = first.query(Cluster).filter_by(name="alpha").one()
            ingest.store_usage(first, cluster, counts)
            thread = threading.Thread(target=second_writer, daemon=True)
            thread.start()
            _wait_for_a_lock_wait(engine)
            first.commit()
        thread.join(LOCK_WAIT_DEADLINE_S)
        assert not thread.is_alive(), "the second writer never finished"
        assert errors == []
        with sessions() as session:
            stored = session.execute(text("SELECT checkpoint, sessions FROM usage_counts")).all()
        assert sorted(stored) == [("mace-mp-0-small", 2), ("other", 2)]
    finally:
        engine.dispose()


def _wait_for_a_lock_wait(engine) -> None:
    """Return once some session of this database waits on a lock (the second writer)."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + LOCK_WAIT_DEADLINE_S
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            if conn.execute(query).scalar():
                return
        time.sleep(0.05)
    pytest.fail("the second writer never waited for the first")
