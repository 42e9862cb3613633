"""The checkpoint catalogue and the ``tampered`` state on a live dashboard, per backend.

Pushes go in through the API as ``rootstock manifest push`` sends them (each checkpoint
with its ``info``), and as an older client sends them (without); the catalogue is read
back as JSON (``GET /api/v1/catalogue``) and as the ``/catalogue`` page, and a
tampered checkpoint is read back from every page and view that shows a failed one.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.dashboard.manifests import manifest, record
from tests.dashboard.test_pages import body_rows, get, push, table_rows

pytestmark = pytest.mark.timeout(120)

TAMPERED = (
    "weights of {id} changed since add: cache/x/{id}.model sha256 3f2a… ≠ 9b41… "
    "(size 11 MB → 11 MB); re-run rootstock add {id} to accept the new file"
)


@pytest.fixture
def family() -> str:
    return f"cat{uuid.uuid4().hex[:8]}"


def catalogue_json(dashboard) -> dict[str, dict]:
    response = httpx.get(f"{dashboard.url}api/v1/catalogue", timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["version"] == 1 and "generated_at" in body
    return {entry["checkpoint"]: entry for entry in body["checkpoints"]}


def pushed(live_dashboard, family: str) -> dict:
    """Two clusters: one with info (a current client), one without (an older client)."""
    ok, tampered, fetched = f"{family}-ok", f"{family}-tampered", f"{family}-new"
    message = TAMPERED.format(id=tampered)
    new, new_headers = live_dashboard.cluster_with_key("new")
    body = manifest(
        new,
        {
            family: {
                ok: {"gpu": record(family), "cpu": record(family, kind="cpu")},
                tampered: {"gpu": record(family, "tampered", message=message)},
                fetched: {},
            }
        },
    )
    entries = body["envs"][family]["checkpoints"]
    entries[ok]["info"] = {"licence": "MIT", "gated": None, "citation": "arXiv:2401.00096"}
    entries[tampered]["info"] = {
        "licence": "LicenseRef-FAIR-Chem",
        "gated": "https://huggingface.co/facebook/UMA",
        "citation": "10.1038/s42256-023-00716-3",
    }
    entries[fetched]["info"] = {"licence": None, "gated": None, "citation": None}
    push(live_dashboard, new, new_headers, body)
    old, old_headers = live_dashboard.cluster_with_key("old")
    push(live_dashboard, old, old_headers, manifest(old, {family: {ok: {"cpu": record(
        family, kind="cpu")}}}))  # fmt: skip
    return {"new": new, "old": old, "ok": ok, "tampered": tampered, "fetched": fetched,
            "message": message}  # fmt: skip


def test_catalogue_api_lists_info_and_where_each_checkpoint_is_verified(live_dashboard, family):
    site = pushed(live_dashboard, family)
    entries = catalogue_json(live_dashboard)
    ok = entries[site["ok"]]
    assert (ok["family"], ok["described"], ok["licence"], ok["gated"], ok["citation"]) == (
        family,
        True,
        "MIT",
        None,
        "arXiv:2401.00096",
    )
    assert ok["verified_on"] == sorted([site["new"], site["old"]])
    by_cluster = {c["cluster"]: c for c in ok["clusters"]}
    devices = by_cluster[site["new"]]["devices"]
    assert [(d["device_kind"], d["state"], d["at"]) for d in devices] == [
        ("cpu", "verified", "2026-11-28T10:00:00+00:00"),
        ("gpu", "verified", "2026-11-28T10:00:00+00:00"),
    ]
    assert devices[1]["device"] == "cuda:0"

    tampered = entries[site["tampered"]]
    assert tampered["gated"] == "https://huggingface.co/facebook/UMA"
    assert tampered["verified_on"] == []
    (place,) = tampered["clusters"]
    assert (place["state"], place["message"]) == ("tampered", site["message"])

    fetched = entries[site["fetched"]]  # described by the env file, which gives nothing
    assert fetched["described"] is True and fetched["licence"] is None
    assert fetched["clusters"][0]["state"] == "fetched" and fetched["clusters"][0]["devices"] == []


def test_an_older_client_without_info_is_accepted_and_shown_unknown(live_dashboard, family):
    cluster, headers = live_dashboard.cluster_with_key("legacy")
    checkpoint = f"{family}-legacy"
    push(live_dashboard, cluster, headers, manifest(cluster, {family: {checkpoint: {
        "gpu": record(family)}}}))  # fmt: skip
    entry = catalogue_json(live_dashboard)[checkpoint]
    assert entry["described"] is False
    assert entry["verified_on"] == [cluster]
    (row,) = [r for r in body_rows(get(live_dashboard, "/catalogue"), "catalogue")
              if r["cells"][0] == checkpoint]  # fmt: skip
    assert row["cells"][2:5] == ["unknown", "unknown", "unknown"]


def test_a_malformed_info_is_refused_with_422_naming_it(live_dashboard, family):
    cluster, headers = live_dashboard.cluster_with_key()
    body = manifest(cluster, {family: {f"{family}-x": {"gpu": record(family)}}})
    body["envs"][family]["checkpoints"][f"{family}-x"]["info"] = {"licence": 3}
    response = httpx.put(
        f"{live_dashboard.url}api/v1/clusters/{cluster}/manifest",
        json=body,
        headers=headers,
        timeout=30,
    )
    assert response.status_code == 422
    (error,) = response.json()["detail"]
    assert error["loc"][-2:] == ["info", "licence"]
    assert f"{family}-x" not in catalogue_json(live_dashboard)


def test_catalogue_is_public_and_takes_no_writes(live_dashboard):
    assert httpx.get(f"{live_dashboard.url}api/v1/catalogue", timeout=30).status_code == 200
    for method in ("PUT", "POST", "DELETE"):
        response = httpx.request(method, f"{live_dashboard.url}api/v1/catalogue", timeout=30)
        assert response.status_code in (401, 405), method


def test_catalogue_page_shows_info_links_and_where_verified(live_dashboard, family):
    site = pushed(live_dashboard, family)
    html = get(live_dashboard, "/catalogue")
    assert 'href="/catalogue" class="on"' in html  # in the navigation, and the current page
    rows = {r["cells"][0]: r for r in body_rows(html, "catalogue")}
    header = table_rows(html, "catalogue")[0]["cells"]
    assert header == ["checkpoint", "family", "licence", "weights", "citation", "verified on",
                      "elsewhere"]  # fmt: skip
    ok = rows[site["ok"]]
    assert ok["cells"][1:5] == [family, "MIT", "open", "arXiv:2401.00096"]
    assert "https://arxiv.org/abs/2401.00096" in ok["links"]
    assert site["new"] in ok["cells"][5] and site["old"] in ok["cells"][5]
    assert "cuda:0" in ok["cells"][5] and "2026-11-28 10:00 UTC" in ok["cells"][5]
    assert ok["attrs"]["data-verified"] == " ".join(sorted([site["new"], site["old"]]))

    tampered = rows[site["tampered"]]
    assert tampered["cells"][3] == "gated request access"
    assert "https://huggingface.co/facebook/UMA" in tampered["links"]
    assert "https://doi.org/10.1038/s42256-023-00716-3" in tampered["links"]
    assert tampered["cells"][5] == "nowhere"
    assert tampered["cells"][6].startswith(f"{site['new']} tampered (gpu)")
    assert site["message"] in tampered["cells"][6]  # the reason, as text
    assert rows[site["fetched"]]["cells"][2:5] == ["—", "open", "—"]
    assert "<script" not in html


def test_tampered_is_shown_like_failed_on_every_page(live_dashboard, family):
    cluster, headers = live_dashboard.cluster_with_key()
    checkpoint = f"{family}-t"
    message = TAMPERED.format(id=checkpoint)
    push(live_dashboard, cluster, headers, manifest(cluster, {family: {checkpoint: {
        "gpu": record(family, "tampered", message=message)}}}))  # fmt: skip

    # The coverage matrix: the cell, its colour, its reason in the tooltip; the filter.
    html = get(live_dashboard, f"/?state=tampered&family={family}")
    rows = table_rows(html, "coverage")
    column = rows[0]["cells"].index(next(c for c in rows[0]["cells"] if c.startswith(cluster)))
    (row,) = [r for r in rows if r["attrs"].get("class") == "checkpoint"]
    assert row["classes"][column] == "s-tampered" and row["cells"][column].startswith("tampered")
    assert message in html
    assert '<option value="tampered" selected>' in html
    assert "s-tampered" in html and "a weight file changed since it was added" in html  # legend

    # The cluster page: the current state and the history, each with the reason.
    html = get(live_dashboard, f"/clusters/{cluster}")
    (current,) = body_rows(html, "current")
    assert current["attrs"]["data-state"] == "tampered"
    assert current["cells"][2] == "tampered" and current["cells"][5] == message
    (event,) = body_rows(html, "history")
    assert event["cells"][2] == "tampered" and event["cells"][-1] == message

    # The JSON coverage view, filtered by the state.
    response = httpx.get(
        f"{live_dashboard.url}api/v1/coverage",
        params={"state": "tampered", "cluster": cluster},
        timeout=30,
    )
    assert response.status_code == 200
    (entry,) = response.json()["checkpoints"]
    assert entry["cells"][cluster]["state"] == "tampered"
    assert entry["cells"][cluster]["message"] == message
