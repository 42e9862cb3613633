"""Hostile but well-formed input from a key holder: refused cleanly, or shown safely.

A key holder can send anything the schema allows. Times are checked on arrival
(ISO-8601, years 2000-2200), names that no cluster could have are refused before
the database sees them, and whatever was stored, every page and read still
answers without a server error, on both backends.
"""

from __future__ import annotations

import copy

import httpx
import pytest

from tests.dashboard import manifests
from tests.dashboard.conftest import unique
from tests.dashboard.test_api import put_manifest, simple, usage_row

pytestmark = pytest.mark.timeout(300)

HOSTILE_TIMES = [
    "9999-12-31T23:59:59-12:00",  # past the calendar's end once shifted to UTC
    "0001-01-01T00:00:00+14:00",  # before its start once shifted
    "2201-01-01T00:00:00+00:00",
    "1999-12-31T23:59:59+00:00",
    "yesterday",
    "",
]


def _set_time(body: dict, cluster: str, field: str, value: str) -> None:
    env = body["envs"]["mace"]
    entry = env["checkpoints"]["mace-mp-0-small"]
    record = entry["verifications"][cluster]["gpu"]
    target = {
        "at": record,
        "fetched_at": entry,
        "built_at": env,
        "build.built_at": record["build"],
    }[field]
    target[field.rpartition(".")[2]] = value


def _every_view_answers(dashboard, cluster: str) -> None:
    """Every page and read that shows ``cluster``'s data answers without a 5xx."""
    for path in (
        "",
        f"clusters/{cluster}",
        "usage",
        "?state=verified",
        "api/v1/coverage",
        "api/v1/clusters",
        f"api/v1/clusters/{cluster}/manifest",
        f"api/v1/clusters/{cluster}/pushes",
    ):
        response = httpx.get(f"{dashboard.url}{path}", timeout=30)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])


@pytest.mark.parametrize("field", ["at", "fetched_at", "built_at", "build.built_at"])
@pytest.mark.parametrize("value", HOSTILE_TIMES)
def test_times_outside_the_calendar_get_422(live_dashboard, field, value):
    cluster, auth = live_dashboard.cluster_with_key("time")
    assert put_manifest(live_dashboard, cluster, simple(cluster), auth).status_code == 200
    body = simple(cluster)
    _set_time(body, cluster, field, value)
    response = put_manifest(live_dashboard, cluster, body, auth)
    assert response.status_code == 422, response.text
    assert any(field.rpartition(".")[2] in error["loc"] for error in response.json()["detail"])
    _every_view_answers(live_dashboard, cluster)


def test_hostile_but_valid_data_is_shown_safely(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key("odd")
    long_name = "x" * 200
    failed = manifests.record("mace", "failed", message="<script>x</script>")
    body = manifests.manifest(
        cluster,
        {
            "<b>mace</b>": {
                "mace-edge-early": {
                    "gpu": manifests.record("mace", at="2000-01-01T00:00:00Z"),
                    "cpu": manifests.record("mace", kind="cpu", at="2000-01-01T14:00:00+14:00"),
                },
                "mace-edge-late": {
                    "gpu": manifests.record(
                        "mace", "drifted", at="2200-12-31T11:59:59.999999-12:00", message="\u202e"
                    )
                },
                "mace-naive": {"gpu": manifests.record("mace", at="2026-11-28T10:00:00")},
                long_name: {"gpu": failed},
            },
        },
    )
    body["envs"]["<b>mace</b>"]["built_at"] = "2000-01-01T00:00:00-00:00"
    response = put_manifest(live_dashboard, cluster, body, auth)
    assert response.status_code == 200, response.text
    usage = httpx.post(
        f"{live_dashboard.url}api/v1/clusters/{cluster}/usage",
        json={
            "version": 1,
            "counts": [
                usage_row(month="0001-01", sessions=2**31 - 1, distinct_users=2**31 - 1),
                usage_row(month="9999-12", checkpoint=long_name, env="<i>"),
            ],
        },
        headers=auth,
    )
    assert usage.status_code == 200, usage.text
    _every_view_answers(live_dashboard, cluster)
    page = httpx.get(f"{live_dashboard.url}clusters/{cluster}").text
    assert "<script>x</script>" not in page
    assert "2200-12-31 23:59 UTC" in page  # the late edge, shown in UTC


def test_hostile_times_stored_before_the_check_still_render(live_dashboard):
    """Times a server without the arrival check would have stored: pages still answer.

    Ingest now refuses them too (it stores times in UTC, and these have no UTC
    form), so the push is stored with good times and the rows are then given the
    hostile ones, as such a server stored them.
    """
    import json

    from sqlalchemy import update

    from rootstock.dashboard import ingest
    from rootstock.dashboard.models import (
        Cluster,
        ClusterEnv,
        CoverageCell,
        ManifestPush,
        VerificationEvent,
    )

    cluster = live_dashboard.add_cluster(unique("old"))
    body = simple(cluster)
    hostile = copy.deepcopy(body)
    _set_time(hostile, cluster, "at", "9999-12-31T23:59:59-12:00")
    _set_time(hostile, cluster, "built_at", "0001-01-01T00:00:00+14:00")
    hostile["envs"]["chgnet"]["checkpoints"]["chgnet-0.3.0"]["verifications"][cluster]["cpu"][
        "at"
    ] = "0001-01-01T00:00:00+14:00"
    with pytest.raises(ingest.ManifestShapeError, match="UTC"):
        ingest.check_manifest_shape(hostile)
    with live_dashboard._write() as session:
        target = session.query(Cluster).filter_by(name=cluster).one()
        push = ingest.store_push(session, target, body, None)
        mine = {"cluster_id": target.id}
        session.execute(update(ManifestPush).filter_by(id=push.id).values(body=json.dumps(hostile)))
        session.execute(
            update(ClusterEnv)
            .filter_by(**mine, name="mace")
            .values(built_at="0001-01-01T00:00:00+14:00")
        )
        for env, at in (
            ("mace", "9999-12-31T23:59:59-12:00"),
            ("chgnet", "0001-01-01T00:00:00+14:00"),
        ):
            session.execute(update(CoverageCell).filter_by(**mine, env=env).values(verified_at=at))
            session.execute(update(VerificationEvent).filter_by(**mine, env=env).values(at=at))
    _every_view_answers(live_dashboard, cluster)


# --- names no cluster can have --------------------------------------------------------------
@pytest.mark.parametrize("write", ["manifest", "usage"])
def test_write_to_an_impossible_cluster_name_is_403(live_dashboard, write):
    """A NUL in the path's cluster: refused before the database is asked (no 503)."""
    cluster, auth = live_dashboard.cluster_with_key("nul")
    url = f"{live_dashboard.url}api/v1/clusters/{cluster}%00x/{write}"
    if write == "manifest":
        response = httpx.put(url, json=simple(cluster), headers=auth, timeout=30)
    else:
        response = httpx.post(url, json={"version": 1, "counts": []}, headers=auth, timeout=30)
    assert response.status_code == 403, response.text
    assert "may not write" in response.json()["detail"]


@pytest.mark.parametrize(
    ("path", "status", "kind"),
    [
        ("clusters/a%00b", 404, "text/html"),
        ("?family=%00", 200, "text/html"),
        ("?family=mace%00&state=verified", 200, "text/html"),
        ("?state=%00", 200, "text/html"),
        ("api/v1/clusters/a%00b/manifest", 404, "application/json"),
        ("api/v1/clusters/a%00b/pushes", 404, "application/json"),
        ("api/v1/coverage?family=%00", 422, "application/json"),
        ("api/v1/coverage?cluster=a%00b", 422, "application/json"),
    ],
)
def test_reads_with_impossible_names_never_reach_the_database(live_dashboard, path, status, kind):
    response = httpx.get(f"{live_dashboard.url}{path}", timeout=30)
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"].startswith(kind)
