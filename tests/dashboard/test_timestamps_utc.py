"""Pushed times are stored in UTC, so "latest" and history order are by instant.

Against real servers on real SQLite and PostgreSQL databases. The rows the views
sort and compare (events, cells, envs) hold UTC; the history body stays as sent.
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import select, text

from rootstock.dashboard import views
from rootstock.dashboard.models import Cluster, ClusterEnv, CoverageCell, VerificationEvent
from tests.dashboard import manifests

pytestmark = pytest.mark.timeout(300)

# Four sites' clocks. As text "10:00+05:00" sorts after "06:00": as instants it is
# an hour before.
EARLY_LOCAL = "2026-01-01T10:00:00+05:00"  # 05:00 UTC
LATE_NAIVE = "2026-01-01T06:00:00"  # no offset: UTC, 06:00
BUILT_LOCAL = "2026-11-01T13:00:00+05:00"  # 08:00 UTC
FETCHED_Z = "2026-11-02T09:00:00Z"


def mixed_offsets(cluster: str) -> dict:
    """One checkpoint verified on GPU at 05:00 UTC and on CPU at 06:00 UTC, local clocks."""
    gpu = manifests.record("mace", at=EARLY_LOCAL)
    cpu = manifests.record("mace", at=LATE_NAIVE, kind="cpu")
    for record in (gpu, cpu):
        record["build"]["built_at"] = BUILT_LOCAL  # as the install wrote it for the env
    out = manifests.manifest(cluster, {"mace": {"mace-small": {"gpu": gpu, "cpu": cpu}}})
    out["envs"]["mace"]["built_at"] = BUILT_LOCAL
    out["envs"]["mace"]["checkpoints"]["mace-small"]["fetched_at"] = FETCHED_Z
    return out


def put(dashboard, cluster: str, body: dict, auth: dict[str, str]) -> httpx.Response:
    """PUT ``body`` as ``cluster``'s manifest."""
    return httpx.put(
        f"{dashboard.url}api/v1/clusters/{cluster}/manifest", json=body, headers=auth, timeout=30
    )


def test_mixed_offsets_are_stored_in_utc_and_ordered_by_instant(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key("utc")
    sent = mixed_offsets(cluster)
    assert put(live_dashboard, cluster, sent, auth).status_code == 200

    coverage = httpx.get(f"{live_dashboard.url}api/v1/coverage", params={"cluster": cluster})
    (row,) = coverage.json()["checkpoints"]
    cell = row["cells"][cluster]
    # The latest is the CPU run, by instant; the build times compared as sent, so the
    # cell is verified, not stale.
    assert (cell["device_kind"], cell["verified_at"]) == ("cpu", "2026-01-01T06:00:00+00:00")
    assert cell["state"] == "verified"

    with live_dashboard._sessions() as session:
        detail = views.cluster_detail(session, cluster)
        cluster_id = session.scalars(select(Cluster.id).where(Cluster.name == cluster)).one()
        env = session.get(ClusterEnv, (cluster_id, "mace"))
        stored_cell = session.get(CoverageCell, (cluster_id, "mace", "mace-small"))
    (checkpoint,) = detail["checkpoints"]
    assert [(e["device_kind"], e["at"]) for e in checkpoint["history"]] == [
        ("cpu", "2026-01-01T06:00:00+00:00"),
        ("gpu", "2026-01-01T05:00:00+00:00"),
    ]
    assert env.built_at == "2026-11-01T08:00:00+00:00"
    assert stored_cell.fetched_at == "2026-11-02T09:00:00+00:00"

    # The history keeps the body as it was sent, local offsets and all.
    latest = httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/manifest").json()
    assert latest["manifest"] == sent


def test_latest_of_two_envs_is_by_instant(live_dashboard):
    """One checkpoint served by two envs: the cell shows the one verified last."""
    cluster, auth = live_dashboard.cluster_with_key("utc")
    body = manifests.manifest(
        cluster,
        {
            "mace": {"shared-ckpt": {"gpu": manifests.record("mace", at=EARLY_LOCAL)}},
            "mace-alpha": {
                "shared-ckpt": {
                    "gpu": manifests.record("mace-alpha", at="2026-01-01T01:00:00-05:00")
                }
            },
        },
    )
    assert put(live_dashboard, cluster, body, auth).status_code == 200
    coverage = httpx.get(f"{live_dashboard.url}api/v1/coverage", params={"cluster": cluster})
    (row,) = coverage.json()["checkpoints"]
    cell = row["cells"][cluster]
    assert (cell["env"], cell["verified_at"]) == ("mace-alpha", "2026-01-01T06:00:00+00:00")


def test_one_instant_written_two_ways_is_one_history_event(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key("utc")
    for at in (EARLY_LOCAL, "2026-01-01T05:00:00Z", "2026-01-01T05:00:00+00:00"):
        body = manifests.manifest(
            cluster, {"mace": {"m": {"gpu": manifests.record("mace", at=at)}}}
        )
        assert put(live_dashboard, cluster, body, auth).status_code == 200
    with live_dashboard._sessions() as session:
        cluster_id = session.scalars(select(Cluster.id).where(Cluster.name == cluster)).one()
        events = session.scalars(
            select(VerificationEvent.at).where(VerificationEvent.cluster_id == cluster_id)
        ).all()
    assert events == ["2026-01-01T05:00:00+00:00"]


def _bad_time(cluster: str, where: str) -> tuple[dict, list]:
    """A manifest with "yesterday" at ``where``, and the loc the 422 should name."""
    body = manifests.manifest(cluster, {"mace": {"m": {"gpu": manifests.record("mace")}}})
    env = body["envs"]["mace"]
    record = env["checkpoints"]["m"]["verifications"][cluster]["gpu"]
    record_loc = ["body", "envs", "mace", "checkpoints", "m", "verifications", cluster, "gpu"]
    if where == "at":
        record["at"] = "yesterday"
        return body, [*record_loc, "at"]
    if where == "build.built_at":
        record["build"]["built_at"] = "yesterday"
        return body, [*record_loc, "build", "built_at"]
    if where == "fetched_at":
        env["checkpoints"]["m"]["fetched_at"] = "2026-13-01T00:00:00+00:00"
        return body, ["body", "envs", "mace", "checkpoints", "m", "fetched_at"]
    env["built_at"] = "1 Nov 2026"
    return body, ["body", "envs", "mace", "built_at"]


@pytest.mark.parametrize("where", ["at", "build.built_at", "fetched_at", "env.built_at"])
def test_a_time_that_is_not_iso_8601_is_422_naming_the_field(live_dashboard, where):
    cluster, auth = live_dashboard.cluster_with_key("utc")
    body, loc = _bad_time(cluster, where)
    response = put(live_dashboard, cluster, body, auth)
    assert response.status_code == 422, response.text
    assert [error["loc"] for error in response.json()["detail"]] == [loc]
    assert "ISO-8601" in response.json()["detail"][0]["msg"]
    pushes = httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/pushes").json()
    assert pushes["pushes"] == []  # nothing stored


@pytest.mark.parametrize("where", ["at", "fetched_at", "env.built_at"])
def test_ingest_itself_refuses_a_time_it_cannot_normalise(where):
    """store_push's own check (its callers are not only the API): the path is named."""
    from rootstock.dashboard.ingest import ManifestShapeError, check_manifest_shape

    body, loc = _bad_time("alpha", where)
    with pytest.raises(ManifestShapeError, match="ISO-8601") as refused:
        check_manifest_shape(body)
    assert f".{loc[-1]}:" in str(refused.value)
    assert "envs['mace']" in str(refused.value)


def test_upgrade_to_0003_normalises_stored_times(dashboard_backend, new_database):
    """Rows stored by 0002 with local offsets are in UTC after the upgrade; twins merge."""
    from alembic import command
    from alembic.config import Config

    from rootstock.dashboard.db import MIGRATIONS, database_url, make_engine, migrate

    engine = make_engine(database_url(new_database(dashboard_backend)))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0002")
        event = (
            "INSERT INTO verification_events (cluster_id, env, checkpoint, device_kind, at,"
            " state, push_id) VALUES (:c, 'mace', 'm', :k, :at, 'verified', 1)"
        )
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO clusters (name, created_at) VALUES ('old', :t)"),
                         {"t": "2026-11-28 10:00:00"})  # fmt: skip
            c = conn.execute(text("SELECT id FROM clusters")).scalar()
            for kind, at in [
                ("gpu", EARLY_LOCAL),
                ("gpu", "2026-01-01T05:00:00Z"),  # the same instant: merged
                ("cpu", LATE_NAIVE),
                ("cpu", "2026-01-01T07:00:00+00:00"),  # canonical already
                ("xpu", "not a time"),  # left alone
            ]:
                conn.execute(text(event), {"c": c, "k": kind, "at": at})
            conn.execute(
                text(
                    "INSERT INTO coverage_cells (cluster_id, env, checkpoint, family, state,"
                    " verified_at, fetched_at, push_id) VALUES (:c, 'mace', 'm', 'mace',"
                    " 'verified', :v, :f, 1)"
                ),
                {"c": c, "v": EARLY_LOCAL, "f": FETCHED_Z},
            )
            conn.execute(
                text(
                    "INSERT INTO cluster_envs (cluster_id, name, built_at, push_id)"
                    " VALUES (:c, 'mace', :b, 1)"
                ),
                {"c": c, "b": BUILT_LOCAL},
            )
        migrate(engine)
        with engine.connect() as conn:
            events = conn.execute(
                text("SELECT device_kind, at FROM verification_events ORDER BY device_kind, at")
            ).all()
            cell = conn.execute(text("SELECT verified_at, fetched_at FROM coverage_cells")).one()
            built = conn.execute(text("SELECT built_at FROM cluster_envs")).scalar()
        assert [tuple(e) for e in events] == [
            ("cpu", "2026-01-01T06:00:00+00:00"),
            ("cpu", "2026-01-01T07:00:00+00:00"),
            ("gpu", "2026-01-01T05:00:00+00:00"),
            ("xpu", "not a time"),
        ]
        assert tuple(cell) == ("2026-01-01T05:00:00+00:00", "2026-11-02T09:00:00+00:00")
        assert built == "2026-11-01T08:00:00+00:00"
    finally:
        engine.dispose()
