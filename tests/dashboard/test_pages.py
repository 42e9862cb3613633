"""The HTML pages of a live dashboard (real server on loopback, real database).

Data goes in through the API as a maintainer would push it; the pages are read
back over HTTP and parsed with the standard library's HTML parser. Tests share
one server, so each uses its own cluster and family (env) names.
"""

from __future__ import annotations

import uuid
from html.parser import HTMLParser
from typing import Any

import httpx
import pytest

from tests.dashboard.conftest import unique
from tests.dashboard.manifests import checks, manifest, record

pytestmark = pytest.mark.timeout(120)

XSS_ENV = "<script>alert(1)</script>"
XSS_CHECKPOINT = '<img src=x onerror="alert(2)">'
XSS_MESSAGE = "<b onmouseover=alert(3)>boom</b> & done"


class Rows(HTMLParser):
    """Every ``<tr>`` of the table with a given id: its attributes and cell texts."""

    def __init__(self, table_id: str) -> None:
        super().__init__()
        self.table_id = table_id
        self.depth = 0  # >0 while inside the wanted table
        self.rows: list[dict[str, Any]] = []
        self._cell: list[str] | None = None
        self._section = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "table" and (self.depth or found.get("id") == self.table_id):
            self.depth += 1
        elif self.depth and tag in ("thead", "tbody"):
            self._section = tag
        elif self.depth and tag == "tr":
            self.rows.append(
                {"attrs": found, "cells": [], "classes": [], "links": [], "in": self._section}
            )
        elif self.depth and tag in ("td", "th") and self.rows:
            self._cell = []
            self.rows[-1]["classes"].append(found.get("class") or "")
        elif self.depth and tag == "a" and self.rows:
            self.rows[-1]["links"].append(found.get("href"))

    def handle_endtag(self, tag: str) -> None:
        if tag == "table" and self.depth:
            self.depth -= 1
        elif tag in ("td", "th") and self._cell is not None and self.rows:
            self.rows[-1]["cells"].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def table_rows(html: str, table_id: str) -> list[dict[str, Any]]:
    """The rows of table ``table_id`` in ``html``."""
    parser = Rows(table_id)
    parser.feed(html)
    return parser.rows


def body_rows(html: str, table_id: str) -> list[dict[str, Any]]:
    """The rows of ``table_id`` without its header row."""
    return [r for r in table_rows(html, table_id) if r["in"] == "tbody"]


def get(dashboard, path: str, status: int = 200) -> str:
    response = httpx.get(dashboard.url + path.lstrip("/"), timeout=30)
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("text/html")
    return response.text


def push(dashboard, cluster: str, headers: dict[str, str], body: dict) -> dict:
    response = httpx.put(
        f"{dashboard.url}api/v1/clusters/{cluster}/manifest", json=body, headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def family() -> str:
    """An env (family) name no other test uses."""
    return f"fam{uuid.uuid4().hex[:8]}"


def test_coverage_page_shows_each_pushed_cell(live_dashboard, family):
    other = f"{family}x"
    cluster, headers = live_dashboard.cluster_with_key()
    body = manifest(
        cluster,
        {
            family: {
                f"{family}-ok": {"gpu": record(family)},
                f"{family}-bad": {"gpu": record(family, "failed", message="CUDA out of memory")},
                f"{family}-new": {},
            },
            other: {f"{other}-one": {"cpu": record(other, "drifted", kind="cpu")}},
        },
    )
    body["envs"][other]["built_at"] = "2026-11-29T00:00:00+00:00"  # rebuilt: stale
    push(live_dashboard, cluster, headers, body)

    html = get(live_dashboard, "/")
    rows = table_rows(html, "coverage")
    header = rows[0]
    column = header["cells"].index(next(c for c in header["cells"] if c.startswith(cluster)))
    assert f"/clusters/{cluster}" in header["links"]
    by_id = {r["cells"][0]: r for r in rows if r["attrs"].get("class") == "checkpoint"}
    expected = {
        f"{family}-ok": ("s-verified", "verified"),
        f"{family}-bad": ("s-failed", "failed"),
        f"{family}-new": ("s-fetched", "fetched"),
        f"{other}-one": ("s-stale", "stale"),
    }
    for checkpoint, (css, text) in expected.items():
        row = by_id[checkpoint]
        assert row["classes"][column] == css, checkpoint
        assert row["cells"][column].startswith(text), checkpoint
    # The age of the last verification is shown (the fixture verified on 2026-11-28).
    assert by_id[f"{family}-ok"]["cells"][column].split()[-1] in ("d", "mo")
    families = [r["attrs"]["data-family"] for r in rows if r["attrs"].get("class") == "family"]
    assert family in families and other in families
    assert "CUDA out of memory" in html  # the message, in the cell's title
    assert "script-src" not in html and "<script" not in html  # the page needs no script


def test_filters_keep_only_matching_rows(live_dashboard, family):
    cluster, headers = live_dashboard.cluster_with_key()
    body = manifest(
        cluster,
        {
            family: {f"{family}-a": {"gpu": record(family)}, f"{family}-b": {}},
            f"{family}z": {f"{family}z-c": {"gpu": record(f"{family}z", "failed")}},
        },
    )
    push(live_dashboard, cluster, headers, body)

    html = get(live_dashboard, f"/?family={family}")
    rows = [r for r in table_rows(html, "coverage") if "data-family" in r["attrs"]]
    assert {r["attrs"]["data-family"] for r in rows} == {family}
    assert sorted(r["cells"][0] for r in rows if r["attrs"]["class"] == "checkpoint") == [
        f"{family}-a",
        f"{family}-b",
    ]
    assert f'<option value="{family}" selected>' in html

    html = get(live_dashboard, f"/?family={family}&state=fetched")
    rows = [r for r in table_rows(html, "coverage") if r["attrs"].get("class") == "checkpoint"]
    assert [r["cells"][0] for r in rows] == [f"{family}-b"]
    assert all("fetched" in r["attrs"]["data-state"].split() for r in rows)

    html = get(live_dashboard, f"/?family={family}&state=drifted")
    assert table_rows(html, "coverage") == []
    assert "No checkpoint matches these filters" in html


def test_cluster_page_lists_envs_and_verification_history(live_dashboard, family):
    cluster, headers = live_dashboard.cluster_with_key()
    checkpoint = f"{family}-small"
    first = manifest(cluster, {family: {checkpoint: {"gpu": record(family)}}}, python="3.11.9")
    push(live_dashboard, cluster, headers, first)
    later = record(family, "drifted", at="2026-11-29T03:00:00+00:00", message="energy moved")
    second = manifest(cluster, {family: {checkpoint: {"gpu": later}}}, python="3.11.9")
    pushed = push(live_dashboard, cluster, headers, second)

    html = get(live_dashboard, f"/clusters/{cluster}")
    (env,) = body_rows(html, "envs")
    assert env["cells"][:5] == [family, "1", "3.11.9", "2.4.0", "0.1.0"]
    history = body_rows(html, "history")
    assert [(h["cells"][0], h["cells"][1], h["cells"][2]) for h in history] == [
        (checkpoint, "gpu", "drifted"),
        (checkpoint, "gpu", "verified"),
    ]
    assert history[0]["cells"][3].startswith("2026-11-29 03:00 UTC")
    assert history[0]["cells"][-1] == "energy moved"
    assert pushed["received_at"] in html  # the last push, exact time in its title
    pushes = body_rows(html, "pushes")
    assert [p["cells"][0] for p in pushes][:1] == [str(pushed["push_id"])]


def test_cluster_page_shows_the_check_ratios_in_the_history(live_dashboard, family):
    cluster, headers = live_dashboard.cluster_with_key()
    checkpoint = f"{family}-small"
    old = record(family, at="2026-11-27T10:00:00+00:00")  # pushed before checks existed
    push(live_dashboard, cluster, headers, manifest(cluster, {family: {checkpoint: {"gpu": old}}}))
    good = {**record(family, at="2026-11-28T10:00:00+00:00"), "checks": checks(1.0003, 0.9998)}
    push(live_dashboard, cluster, headers, manifest(cluster, {family: {checkpoint: {"gpu": good}}}))
    bad = {
        **record(family, "failed", at="2026-11-29T10:00:00+00:00", message="stress is 160.2×"),
        "checks": checks(1.21, 160.2, forces_mode="direct"),
    }
    molecule = {**record(family, at="2026-11-29T11:00:00+00:00"), "checks": checks(0.999, None)}
    push(
        live_dashboard,
        cluster,
        headers,
        manifest(cluster, {family: {checkpoint: {"gpu": bad, "cpu": molecule}}}),
    )

    html = get(live_dashboard, f"/clusters/{cluster}")
    header = table_rows(html, "history")[0]["cells"]
    column = header.index("checks")
    history = body_rows(html, "history")
    assert [(h["cells"][1], h["cells"][2], h["cells"][column]) for h in history] == [
        ("cpu", "verified", "forces 0.999 · stress n/a"),
        ("gpu", "failed", "forces 1.210 (direct) · stress 160.2"),
        ("gpu", "verified", "forces 1.000 · stress 1.000"),
        ("gpu", "verified", "—"),
    ]
    assert history[1]["classes"][column] == "checks"
    assert 'class="bad" data-quantity="stress"' in html
    assert 'class="ok" data-quantity="forces"' in html


def test_unknown_cluster_is_a_404_page(live_dashboard):
    html = get(live_dashboard, "/clusters/no-such-cluster", status=404)
    assert "No cluster named" in html and "no-such-cluster" in html


def test_cluster_that_never_pushed_says_so(live_dashboard):
    cluster = live_dashboard.add_cluster(unique())
    html = get(live_dashboard, f"/clusters/{cluster}")
    assert "has not pushed a manifest yet" in html
    assert table_rows(html, "history") == []


def test_usage_page_charts_the_pushed_counts(live_dashboard, family):
    cluster, headers = live_dashboard.cluster_with_key()
    counts = [
        {"month": "2031-07", "env": family, "checkpoint": f"{family}-a",
         "sessions": 4321, "distinct_users": 17, "force_calls": 99},
        {"month": "2031-07", "env": family, "checkpoint": f"{family}-b",
         "sessions": 12, "distinct_users": 3, "force_calls": 0},
    ]  # fmt: skip
    response = httpx.post(
        f"{live_dashboard.url}api/v1/clusters/{cluster}/usage",
        json={"version": 1, "counts": counts},
        headers=headers,
        timeout=30,
    )
    assert response.status_code == 200, response.text

    html = get(live_dashboard, "/usage?month=2031-07")
    chart = html[html.index('<svg id="usage-chart"') : html.index("</svg>")]
    assert f"{family}-a: 4321 sessions" in chart
    assert f"{family}-a: 17 distinct users" in chart
    assert f"{family}-b: 12 sessions" in chart
    assert '<option value="2031-07" selected>' in html
    rows = {r["cells"][0]: r["cells"] for r in body_rows(html, "usage")}
    assert rows[f"{family}-a"][3:] == ["4321", "17", "99"]
    # The longest bar belongs to the most used checkpoint.
    assert chart.index(f"{family}-a: 4321") < chart.index(f"{family}-b: 12")


def test_an_empty_dashboard_says_nothing_was_pushed(start_dashboard, new_database):
    dashboard = start_dashboard(new_database("sqlite"))
    html = get(dashboard, "/")
    assert "Nothing has been pushed yet" in html
    assert table_rows(html, "coverage") == []
    assert "No usage has been pushed yet" in get(dashboard, "/usage")


def test_pushed_html_renders_as_text(live_dashboard):
    """XSS: names and messages from a push are escaped on every page."""
    cluster, headers = live_dashboard.cluster_with_key()
    failed = record(XSS_ENV, "failed", message=XSS_MESSAGE)
    body = manifest(cluster, {XSS_ENV: {XSS_CHECKPOINT: {"gpu": failed}}})
    body["envs"][XSS_ENV]["checkpoints"][XSS_CHECKPOINT]["info"] = {
        "licence": XSS_ENV,
        "gated": "javascript:alert(5)",  # never a link: only http(s) URLs become one
        "citation": '10.1234/x"><script>alert(6)</script>',  # a DOI by its shape
    }
    push(live_dashboard, cluster, headers, body)
    usage = {"month": "2031-08", "env": XSS_ENV, "checkpoint": XSS_CHECKPOINT,
             "sessions": 1, "distinct_users": 1, "force_calls": 1}  # fmt: skip
    response = httpx.post(
        f"{live_dashboard.url}api/v1/clusters/{cluster}/usage",
        json={"version": 1, "counts": [usage]},
        headers=headers,
        timeout=30,
    )
    assert response.status_code == 200, response.text

    pages = {
        "/": get(live_dashboard, "/"),
        "/?family=...": httpx.get(live_dashboard.url, params={"family": XSS_ENV}, timeout=30).text,
        "/clusters": get(live_dashboard, f"/clusters/{cluster}"),
        "/usage": get(live_dashboard, "/usage?month=2031-08"),
        "/catalogue": get(live_dashboard, "/catalogue"),
        "404": get(live_dashboard, "/clusters/%3Cscript%3Ealert(4)", status=404),
    }
    for name, html in pages.items():
        for raw in (XSS_ENV, XSS_CHECKPOINT, "<b onmouseover"):
            assert raw not in html, f"{name} carries raw {raw!r}"
        assert "<script" not in html, name
    for name in ("/", "/?family=...", "/clusters", "/catalogue"):
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages[name], name
    assert 'href="javascript:' not in pages["/catalogue"]
    assert "javascript:alert(5)" in pages["/catalogue"]  # shown as text
    assert "&lt;script&gt;alert(6)" in pages["/catalogue"]
    assert "&lt;img src=x onerror=&#34;alert(2)&#34;&gt;" in pages["/usage"]
    assert "&lt;b onmouseover=alert(3)&gt;boom&lt;/b&gt; &amp; done" in pages["/clusters"]
    assert "&lt;script&gt;alert(4)" in pages["404"]
    csp = httpx.get(live_dashboard.url, timeout=30).headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp
