"""The JSON API against the real server on loopback, on SQLite and on PostgreSQL.

Every test runs once per backend (``live_dashboard``) and uses clusters of its own.
Requests the ordinary clients cannot make (a header promising a body that never
comes, a chunked body over the limit) go over a raw socket.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import select

from rootstock.dashboard.models import UsageCount
from tests.dashboard import manifests
from tests.dashboard.conftest import bearer, unique

pytestmark = pytest.mark.timeout(300)


def server_timing(response: httpx.Response) -> dict[str, float]:
    """The ``Server-Timing`` metrics of a response, by name (``app``, ``queue``)."""
    metrics = {}
    for part in response.headers["server-timing"].split(","):
        name, _, duration = part.strip().partition(";dur=")
        metrics[name] = float(duration)
    return metrics


def put_manifest(dashboard, cluster: str, body, headers: dict[str, str]) -> httpx.Response:
    """PUT ``body`` (a dict as JSON, or raw bytes) as ``cluster``'s manifest."""
    url = f"{dashboard.url}api/v1/clusters/{cluster}/manifest"
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json", **headers}
        return httpx.put(url, content=body, headers=headers, timeout=30)
    return httpx.put(url, json=body, headers=headers, timeout=30)


def simple(cluster: str, state: str = "verified", at: str = "2026-11-28T10:00:00+00:00"):
    """A manifest with two mace checkpoints and one chgnet checkpoint."""
    rec = manifests.record("mace", state=state, at=at)
    return manifests.manifest(
        cluster,
        {
            "mace": {"mace-mp-0-small": {"gpu": rec}, "mace-mp-0-medium": {}},
            "chgnet": {"chgnet-0.3.0": {"cpu": manifests.record("chgnet", kind="cpu")}},
        },
    )


def raw_request(dashboard, head: str, body_chunks: list[bytes] = (), timeout: float = 20.0):
    """Send ``head`` (request line and headers) and ``body_chunks`` over a raw socket.

    Returns ``(status, headers, body)``; the socket times out rather than hang.
    """
    parts = urlsplit(dashboard.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        for chunk in body_chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered early; its answer is what is checked
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _expected_length(data):
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return status, headers, body


def _expected_length(data: bytes) -> int:
    head, sep, _ = data.partition(b"\r\n\r\n")
    if not sep:
        return 1 << 62
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            return len(head) + 4 + int(value.strip())
    return len(data)


# --- push, replace, history, reads ------------------------------------------------------
def test_push_replaces_manifest_and_keeps_history(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key()
    first = put_manifest(live_dashboard, cluster, simple(cluster), auth)
    assert first.status_code == 200, first.text
    assert first.json()["cluster"] == cluster
    assert (first.json()["envs"], first.json()["checkpoints"]) == (2, 3)
    assert set(server_timing(first)) == {"queue", "app"}

    second_body = manifests.manifest(
        cluster, {"mace": {"mace-mp-0-small": {"gpu": manifests.record("mace", state="failed")}}}
    )
    second = put_manifest(live_dashboard, cluster, second_body, auth)
    assert second.status_code == 200, second.text
    assert second.json()["push_id"] != first.json()["push_id"]

    latest = httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/manifest").json()
    assert latest["push_id"] == second.json()["push_id"]
    assert latest["manifest"]["envs"].keys() == {"mace"}
    assert latest["manifest"]["written_by"] == "rootstock 0.1.0"  # unknown keys are kept

    history = httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/pushes").json()
    assert [p["push_id"] for p in history["pushes"]] == [
        second.json()["push_id"],
        first.json()["push_id"],
    ]
    assert [p["checkpoints"] for p in history["pushes"]] == [1, 3]

    coverage = httpx.get(f"{live_dashboard.url}api/v1/coverage", params={"cluster": cluster})
    rows = {row["checkpoint"]: row["cells"][cluster] for row in coverage.json()["checkpoints"]}
    assert rows.keys() == {"mace-mp-0-small"}  # the replaced push's other rows are gone
    assert rows["mace-mp-0-small"]["state"] == "failed"


def test_coverage_states_and_filters(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key()
    assert put_manifest(live_dashboard, cluster, simple(cluster), auth).status_code == 200
    coverage = httpx.get(f"{live_dashboard.url}api/v1/coverage", params={"cluster": cluster})
    assert coverage.status_code == 200
    assert server_timing(coverage)["app"] >= 0
    cells = {r["checkpoint"]: r["cells"][cluster] for r in coverage.json()["checkpoints"]}
    assert cells["mace-mp-0-small"]["state"] == "verified"
    assert cells["mace-mp-0-small"]["verified_at"] == "2026-11-28T10:00:00+00:00"
    assert cells["mace-mp-0-medium"]["state"] == "fetched"
    assert cells["chgnet-0.3.0"]["device_kind"] == "cpu"

    only_mace = httpx.get(
        f"{live_dashboard.url}api/v1/coverage", params={"cluster": cluster, "family": "mace"}
    ).json()
    assert {r["family"] for r in only_mace["checkpoints"]} == {"mace"}
    fetched = httpx.get(
        f"{live_dashboard.url}api/v1/coverage", params={"cluster": cluster, "state": "fetched"}
    ).json()
    assert [r["checkpoint"] for r in fetched["checkpoints"]] == ["mace-mp-0-medium"]
    bad_state = httpx.get(f"{live_dashboard.url}api/v1/coverage", params={"state": "great"})
    assert bad_state.status_code == 422


def test_cluster_list_and_404_reads(live_dashboard):
    pushed, auth = live_dashboard.cluster_with_key()
    silent = live_dashboard.add_cluster(unique())
    assert put_manifest(live_dashboard, pushed, simple(pushed), auth).status_code == 200
    listed = {
        c["name"]: c for c in httpx.get(f"{live_dashboard.url}api/v1/clusters").json()["clusters"]
    }
    assert listed[pushed]["checkpoints"] == 3
    assert listed[silent]["last_push_at"] is None

    base = f"{live_dashboard.url}api/v1/clusters"
    for path in (
        f"{base}/{unique()}/manifest",
        f"{base}/{silent}/manifest",
        f"{base}/{unique()}/pushes",
        f"{base}/NOT%20A%20NAME/manifest",
    ):
        response = httpx.get(path)
        assert response.status_code == 404, path
        assert isinstance(response.json()["detail"], str)
    assert httpx.get(f"{base}/{silent}/pushes").json() == {"cluster": silent, "pushes": []}


# --- credentials ------------------------------------------------------------------------
def test_key_for_another_cluster_gets_403(live_dashboard):
    mine, auth = live_dashboard.cluster_with_key()
    theirs = live_dashboard.add_cluster(unique())
    response = put_manifest(live_dashboard, theirs, simple(theirs), auth)
    assert response.status_code == 403
    assert theirs in response.json()["detail"]
    usage = httpx.post(
        f"{live_dashboard.url}api/v1/clusters/{theirs}/usage",
        json={"version": 1, "counts": []},
        headers=auth,
    )
    assert usage.status_code == 403
    # ... and an unknown cluster is simply one the key is not scoped to.
    assert put_manifest(live_dashboard, unique(), simple(mine), auth).status_code == 403
    assert httpx.get(f"{live_dashboard.url}api/v1/clusters/{theirs}/pushes").json()["pushes"] == []


def test_key_scoped_to_two_clusters_writes_both(live_dashboard):
    a = live_dashboard.add_cluster(unique("a"))
    b = live_dashboard.add_cluster(unique("b"))
    auth = bearer(*live_dashboard.issue_key(a, b))
    for cluster in (a, b):
        assert put_manifest(live_dashboard, cluster, simple(cluster), auth).status_code == 200


def test_revoked_key_gets_401(live_dashboard):
    cluster = live_dashboard.add_cluster(unique())
    key, secret = live_dashboard.issue_key(cluster)
    assert put_manifest(live_dashboard, cluster, simple(cluster), bearer(key, secret)).is_success
    live_dashboard.revoke(key)
    response = put_manifest(live_dashboard, cluster, simple(cluster), bearer(key, secret))
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    # Another key of the same cluster still works.
    assert put_manifest(
        live_dashboard, cluster, simple(cluster), bearer(*live_dashboard.issue_key(cluster))
    ).is_success


BAD_CREDENTIALS = {
    "missing": lambda key, secret: {},
    "empty": lambda key, secret: {"Authorization": ""},
    "basic scheme": lambda key, secret: {"Authorization": f"Basic {key}:{secret}"},
    "no secret": lambda key, secret: {"Authorization": f"Bearer {key}"},
    "not a key id": lambda key, secret: {"Authorization": f"Bearer nope:{secret}"},
    "unknown key": lambda key, secret: bearer("rsk_" + "0" * 24, secret),
    "wrong secret": lambda key, secret: bearer(key, secret[:-4] + "AAAA"),
    "revoked": "revoked",
}


@pytest.mark.parametrize("credential", BAD_CREDENTIALS)
@pytest.mark.parametrize("target", ["garbage body", "unknown cluster"])
def test_bad_credentials_get_401_whatever_the_body(live_dashboard, credential, target):
    cluster = live_dashboard.add_cluster(unique())
    key, secret = live_dashboard.issue_key(cluster)
    if credential == "revoked":
        live_dashboard.revoke(key)
        headers = bearer(key, secret)
    else:
        headers = BAD_CREDENTIALS[credential](key, secret)
    path_cluster = cluster if target == "garbage body" else unique("ghost")
    body = b"\x00\xff not json {{{" if target == "garbage body" else json.dumps(simple(cluster))
    for endpoint, method in (("manifest", "PUT"), ("usage", "POST")):
        response = httpx.request(
            method,
            f"{live_dashboard.url}api/v1/clusters/{path_cluster}/{endpoint}",
            content=body,
            headers={"Content-Type": "application/json", **headers},
            timeout=30,
        )
        assert response.status_code == 401, (endpoint, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert "app" in server_timing(response)
        assert isinstance(response.json()["detail"], str)
    assert httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/pushes").json()["pushes"] == []


def test_401_comes_before_the_body_is_read(live_dashboard):
    """A header that promises a body which never comes: the answer cannot wait for it."""
    status, headers, body = raw_request(
        live_dashboard,
        f"PUT /api/v1/clusters/{unique()}/manifest HTTP/1.1\n"
        f"Host: 127.0.0.1\nContent-Type: application/json\nContent-Length: 100000\n",
        timeout=20,
    )
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"
    assert json.loads(body)["detail"]


# --- size limit ---------------------------------------------------------------------------
def test_declared_length_over_limit_gets_413_before_reading(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key()
    status, _, body = raw_request(
        live_dashboard,
        f"PUT /api/v1/clusters/{cluster}/manifest HTTP/1.1\nHost: 127.0.0.1\n"
        f"Authorization: {auth['Authorization']}\nContent-Type: application/json\n"
        f"Content-Length: {live_dashboard.max_body + 1}\n",
    )
    assert status == 413
    assert str(live_dashboard.max_body) in json.loads(body)["detail"]


def test_chunked_body_over_limit_gets_413(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key()
    piece = b"[" + b"0," * 32767 + b"0]"  # 64 KiB of valid JSON per chunk, if it were one
    count = live_dashboard.max_body // len(piece) + 2
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(count)] + [b"0\r\n\r\n"]
    status, _, body = raw_request(
        live_dashboard,
        f"PUT /api/v1/clusters/{cluster}/manifest HTTP/1.1\nHost: 127.0.0.1\n"
        f"Authorization: {auth['Authorization']}\nContent-Type: application/json\n"
        "Transfer-Encoding: chunked\n",
        chunks,
    )
    assert status == 413
    assert "limit" in json.loads(body)["detail"]
    assert httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/pushes").json()["pushes"] == []


def test_chunked_body_under_limit_is_accepted(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key()
    payload = json.dumps(simple(cluster)).encode()
    chunks = [payload[i : i + 100] for i in range(0, len(payload), 100)]
    wire = [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks] + [b"0\r\n\r\n"]
    status, _headers, body = raw_request(
        live_dashboard,
        f"PUT /api/v1/clusters/{cluster}/manifest HTTP/1.1\nHost: 127.0.0.1\n"
        f"Authorization: {auth['Authorization']}\nContent-Type: application/json\n"
        "Transfer-Encoding: chunked\nConnection: close\n",
        wire,
    )
    assert status == 200, body
    assert json.loads(body)["checkpoints"] == 3


# --- malformed bodies ---------------------------------------------------------------------
def _wrong_shapes(cluster: str) -> dict[str, object]:
    good = simple(cluster)
    return {
        "a list": [good],
        "no schema_version": {k: v for k, v in good.items() if k != "schema_version"},
        "newer schema": {**good, "schema_version": 99},
        "envs is a list": {**good, "envs": []},
        "env is a string": {**good, "envs": {"mace": "x"}},
        "checkpoints is a list": {**good, "envs": {"mace": {"checkpoints": []}}},
        "path cluster missing": {**good, "clusters": ["elsewhere"]},
        "NUL in an env name": {**good, "envs": {"ma\x00ce": {}}},
        "env name too long": {**good, "envs": {"m" * 201: {}}},
        "checks is a list": _with_checks(cluster, [1.0, 1.0]),
        "a check's ratio is text": _with_checks(
            cluster, {**manifests.checks(), "stress": {"mode": "gradient", "ratio": "160.2"}}
        ),
    }


def _with_checks(cluster: str, checks: object) -> dict:
    """A one-checkpoint manifest whose verification record carries ``checks``."""
    record = {**manifests.record("mace"), "checks": checks}
    return manifests.manifest(cluster, {"mace": {"mace-mp-0-small": {"gpu": record}}})


def test_checks_are_kept_in_the_pushed_manifest(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key()
    checks = manifests.checks(1.01, None)
    response = put_manifest(live_dashboard, cluster, _with_checks(cluster, checks), auth)
    assert response.status_code == 200, response.text
    stored = httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/manifest").json()
    record = stored["manifest"]["envs"]["mace"]["checkpoints"]["mace-mp-0-small"]
    assert record["verifications"][cluster]["gpu"]["checks"] == checks


def test_a_schema_3_manifest_is_kept_with_its_image_and_staged(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key()
    record = {**manifests.record("mace"), "staged": "mount"}
    body = manifests.manifest(cluster, {"mace": {"mace-mp-0-small": {"gpu": record}}})
    image = {
        "file": ".rootstock-image.sqfs",
        "sha256": "3f" * 32,
        "size": 4096,
        "compression": "lz4",
    }
    body["schema_version"] = 3
    body["envs"]["mace"]["image"] = image
    response = put_manifest(live_dashboard, cluster, body, auth)
    assert response.status_code == 200, response.text
    stored = httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/manifest").json()
    assert stored["manifest"] == body
    coverage = httpx.get(f"{live_dashboard.url}api/v1/coverage", params={"cluster": cluster})
    [row] = coverage.json()["checkpoints"]
    assert row["cells"][cluster]["state"] == "verified"


@pytest.mark.parametrize(
    "shape", [*list(_wrong_shapes("x")), "not UTF-8", "invalid JSON", "empty body", "NaN"]
)
def test_malformed_manifest_gets_422(live_dashboard, shape):
    cluster, auth = live_dashboard.cluster_with_key()
    if shape == "not UTF-8":
        body = b'{"schema_version": "\xff\xfe"}'
    elif shape == "invalid JSON":
        body = b'{"schema_version": 1, '
    elif shape == "empty body":
        body = b""
    elif shape == "NaN":
        body = json.dumps(simple(cluster)).replace('"torch": "2.4.0"', '"torch": NaN').encode()
    else:
        body = _wrong_shapes(cluster)[shape]
    response = put_manifest(live_dashboard, cluster, body, auth)
    assert response.status_code == 422, response.text
    assert response.json()["detail"]
    assert httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/pushes").json()["pushes"] == []


def usage_row(**overrides):
    row = {
        "month": "2026-11",
        "env": "mace",
        "checkpoint": "mace-mp-0-small",
        "sessions": 12,
        "distinct_users": 3,
        "force_calls": 4810,
    }
    return {**row, **overrides}


@pytest.mark.parametrize(
    "body",
    [
        {"version": 1, "counts": [usage_row(users=["3f2a9c"])]},
        {"version": 1, "counts": [usage_row()], "records": []},
        {"version": 1, "counts": [usage_row(sessions=-1)]},
        {"version": 1, "counts": [usage_row(month="2026-13")]},
        {"version": 1, "counts": [usage_row(month="Nov 2026")]},
        {"version": 2, "counts": []},
        {"version": 1, "counts": "lots"},
    ],
    ids=["users", "records", "negative", "month 13", "month text", "version", "counts text"],
)
def test_usage_with_anything_but_counts_gets_422(live_dashboard, body):
    cluster, auth = live_dashboard.cluster_with_key()
    response = httpx.post(
        f"{live_dashboard.url}api/v1/clusters/{cluster}/usage", json=body, headers=auth
    )
    assert response.status_code == 422, response.text


def test_usage_push_is_idempotent(live_dashboard):
    cluster, auth = live_dashboard.cluster_with_key()
    url = f"{live_dashboard.url}api/v1/clusters/{cluster}/usage"
    body = {"version": 1, "counts": [usage_row(), usage_row(month="2026-10", sessions=5)]}
    for _ in range(3):
        response = httpx.post(url, json=body, headers=auth)
        assert response.json() == {"cluster": cluster, "rows": 2}
    assert _usage_rows(live_dashboard, cluster) == {
        ("2026-10", "mace-mp-0-small"): (5, 3, 4810),
        ("2026-11", "mace-mp-0-small"): (12, 3, 4810),
    }
    # A month sent again is replaced, not added to; months not sent are kept.
    again = {"version": 1, "counts": [usage_row(sessions=20, distinct_users=4)]}
    assert httpx.post(url, json=again, headers=auth).json()["rows"] == 1
    assert _usage_rows(live_dashboard, cluster)[("2026-11", "mace-mp-0-small")] == (20, 4, 4810)
    assert _usage_rows(live_dashboard, cluster)[("2026-10", "mace-mp-0-small")] == (5, 3, 4810)


def _usage_rows(dashboard, cluster: str) -> dict[tuple[str, str], tuple[int, int, int]]:
    from rootstock.dashboard.models import Cluster

    with dashboard._sessions() as session:
        rows = session.execute(
            select(UsageCount)
            .join(Cluster, Cluster.id == UsageCount.cluster_id)
            .where(Cluster.name == cluster)
        ).scalars()
        return {
            (r.month, r.checkpoint): (r.sessions, r.distinct_users, r.force_calls) for r in rows
        }


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16"])
def test_history_keeps_the_body_readable_whatever_its_encoding(live_dashboard, encoding):
    cluster, auth = live_dashboard.cluster_with_key()
    sent = simple(cluster)
    sent["note"] = "grüße"  # an unknown key, kept
    body = json.dumps(sent, ensure_ascii=False).encode(encoding)
    assert put_manifest(live_dashboard, cluster, body, auth).status_code == 200
    latest = httpx.get(f"{live_dashboard.url}api/v1/clusters/{cluster}/manifest")
    assert latest.status_code == 200
    assert latest.json()["manifest"] == sent


def test_values_are_not_converted(live_dashboard):
    """Strict validation: a string where a number belongs is refused, not converted."""
    cluster, auth = live_dashboard.cluster_with_key()
    response = put_manifest(
        live_dashboard, cluster, {**simple(cluster), "schema_version": "1"}, auth
    )
    assert response.status_code == 422
    usage = httpx.post(
        f"{live_dashboard.url}api/v1/clusters/{cluster}/usage",
        json={"version": 1, "counts": [usage_row(sessions="12")]},
        headers=auth,
    )
    assert usage.status_code == 422
