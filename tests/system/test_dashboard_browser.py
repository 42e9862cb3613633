"""The dashboard's pages in a real browser: Debian's chromium driven by Playwright.

A real ``rootstock dashboard serve`` on loopback (SQLite) is filled through its API,
then chromium loads the coverage matrix, filters it to one family with the form,
follows a cluster's column link and reads the history table; and it follows the
navigation to the checkpoint catalogue and reads licences, gating, citations, where
each checkpoint is verified and a tampered checkpoint's reason. A pushed env name of
``<script>alert(1)</script>`` must stay text: no dialog may open. Playwright never
downloads a browser here: it is pointed at ``/usr/bin/chromium``. Each test saves
screenshots; set ``ROOTSTOCK_TEST_SCREENSHOTS=DIR`` to keep them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.dashboard.conftest import Dashboard, bearer, unique
from tests.dashboard.manifests import manifest, record

pytestmark = [pytest.mark.system, pytest.mark.timeout(180)]

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STEP_TIMEOUT_MS = 20_000  # each Playwright action; the test's own deadline is above
XSS_ENV = "<script>alert(1)</script>"
INFO = {"licence": "MIT", "gated": None, "citation": "arXiv:2401.00096"}
GATED_INFO = {
    "licence": "LicenseRef-FAIR-Chem",
    "gated": "https://huggingface.co/facebook/UMA",
    "citation": "10.1038/s42256-023-00716-3",
}
TAMPERED = (
    "weights of {id} changed since add: cache/x/{id}.model sha256 3f2a… ≠ 9b41… "
    "(size 11 MB → 11 MB); re-run rootstock add {id} to accept the new file"
)


def _unavailable(reason: str) -> None:
    """Skip on a developer machine without a browser; fail in CI, where it must run."""
    if os.environ.get("CI"):
        pytest.fail(f"the browser test must run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser_site(tmp_path_factory) -> Iterator[dict]:
    """A live dashboard with two clusters, three families and a hostile env name."""
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing (apt-get install chromium)")
    db = tmp_path_factory.mktemp("browser-db") / "dashboard.sqlite3"
    dashboard = Dashboard(str(db), tmp_path_factory.mktemp("browser-logs"))
    try:
        dashboard.start()
        families = [f"fam{n}-{unique('x')[2:8]}" for n in range(3)]
        clusters = [dashboard.add_cluster(unique("browser")) for _ in range(2)]
        for index, cluster in enumerate(clusters):
            envs = {
                family: {
                    f"{family}-ckpt{c}": {"gpu": record(family)} if (c + index) % 3 else {}
                    for c in range(4)
                }
                for family in families
            }
            failed = record(XSS_ENV, "failed", message="<b onmouseover=alert(2)>x</b>")
            envs[XSS_ENV] = {"xss-ckpt": {"gpu": failed}}
            if index == 1:
                tampered = f"{families[2]}-ckpt3"
                envs[families[2]][tampered] = {
                    "gpu": record(families[2], "tampered", message=TAMPERED.format(id=tampered))
                }
            if index == 0:
                # a second, older record: the history table then has two rows for it
                first = manifest(cluster, {families[0]: {f"{families[0]}-ckpt1": {
                    "gpu": record(families[0], "failed", at="2026-11-20T08:00:00+00:00",
                                  message="first try failed")}}})  # fmt: skip
                _push(dashboard, cluster, first)
            body = manifest(cluster, envs)
            # What a current client sends; the third family is pushed as an older
            # client would, without info.
            for family, info in ((families[0], INFO), (families[1], GATED_INFO)):
                for entry in body["envs"][family]["checkpoints"].values():
                    entry["info"] = dict(info)
            _push(dashboard, cluster, body)
        yield {"dashboard": dashboard, "families": families, "clusters": clusters}
    finally:
        dashboard.close()


def _push(dashboard: Dashboard, cluster: str, body: dict) -> None:
    headers = bearer(*dashboard.issue_key(cluster))
    response = httpx.put(
        f"{dashboard.url}api/v1/clusters/{cluster}/manifest", json=body, headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text


@contextlib.contextmanager
def _browser_page(tmp_path: Path, dialogs: list[str], errors: list[str]) -> Iterator:
    """A page of a fresh chromium profile; dialogs and script errors are collected."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install 'rootstock[test]')")
    profile = tmp_path / "chromium-profile"  # a fresh user-data-dir
    profile.mkdir()
    with sync_playwright() as playwright:
        # Playwright refuses --user-data-dir among the args; a persistent context is
        # how it takes one.
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(CHROMIUM),
            args=FLAGS,
            headless=True,
            viewport={"width": 1280, "height": 900},
        )
        try:
            context.set_default_timeout(STEP_TIMEOUT_MS)
            page = context.new_page()

            def on_dialog(dialog) -> None:
                dialogs.append(f"{dialog.type}: {dialog.message}")
                dialog.dismiss()

            page.on("dialog", on_dialog)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            yield page
        finally:
            context.close()


def _keep_screenshots(tmp_path: Path, *names: str) -> None:
    """Copy screenshots to ``$ROOTSTOCK_TEST_SCREENSHOTS`` (for a person; CI artifacts)."""
    keep = os.environ.get("ROOTSTOCK_TEST_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for png in names:
            shutil.copy(tmp_path / png, Path(keep) / png)


def test_filter_open_a_cluster_and_read_its_history(browser_site, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    dashboard = browser_site["dashboard"]
    family = browser_site["families"][1]
    cluster = browser_site["clusters"][0]
    dialogs: list[str] = []
    errors: list[str] = []

    with _browser_page(tmp_path, dialogs, errors) as page:
        page.goto(dashboard.url)
        assert page.locator("tr.checkpoint").count() == 13  # 3 x 4 + the hostile one
        assert page.locator("tr.family", has_text=XSS_ENV).count() == 1  # shown as text
        page.screenshot(path=str(tmp_path / "coverage.png"), full_page=True)

        page.select_option("#family", family)
        with page.expect_navigation():
            page.click("form.filters button[type=submit]")
        assert f"family={family}" in page.url
        rows = page.locator("tr[data-family]")
        assert rows.count() == 5  # the family header and its four checkpoints
        assert {rows.nth(i).get_attribute("data-family") for i in range(5)} == {family}

        with page.expect_navigation():
            page.click(f'thead a[href="/clusters/{cluster}"]')
        assert page.url.rstrip("/").endswith(f"/clusters/{cluster}")
        assert page.locator("#cluster-name").inner_text() == cluster
        history = page.locator("#history tbody tr")
        texts = [history.nth(i).inner_text() for i in range(history.count())]
        first_family = browser_site["families"][0]
        ckpt1 = [t for t in texts if t.startswith(f"{first_family}-ckpt1")]
        assert len(ckpt1) == 2 and "first try failed" in ckpt1[1]
        assert any(t.startswith("xss-ckpt") and "failed" in t for t in texts)
        assert page.locator("#envs tbody tr", has_text=XSS_ENV).count() == 1

        shot = tmp_path / "cluster.png"
        page.screenshot(path=str(shot), full_page=True)

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000
    assert dialogs == [], "a pushed value ran as script"
    assert errors == []
    _keep_screenshots(tmp_path, "coverage.png", "cluster.png")


def test_catalogue_from_the_navigation(browser_site, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    dashboard = browser_site["dashboard"]
    families = browser_site["families"]
    clusters = browser_site["clusters"]
    dialogs: list[str] = []
    errors: list[str] = []

    with _browser_page(tmp_path, dialogs, errors) as page:
        page.goto(dashboard.url)
        with page.expect_navigation():
            page.click('header nav a[href="/catalogue"]')
        assert page.url.rstrip("/").endswith("/catalogue")
        assert page.locator("header nav a.on").inner_text() == "Catalogue"
        rows = page.locator("#catalogue tbody tr.checkpoint")
        assert rows.count() == 13  # every checkpoint of both clusters, once

        def row(checkpoint: str):
            return page.locator(f'#catalogue tr[data-checkpoint="{checkpoint}"]')

        # Described by the current client: licence, open weights, a resolvable citation,
        # verified on the clusters where its GPU record is (ckpt1: both; ckpt0: one).
        first = row(f"{families[0]}-ckpt1")
        assert first.locator("td.licence").inner_text() == "MIT"
        assert first.locator("td.gating").inner_text() == "open"
        link = first.locator("td.citation a")
        assert link.get_attribute("href") == "https://arxiv.org/abs/2401.00096"
        verified = first.locator("td.verified li")
        assert sorted(verified.nth(i).get_attribute("data-cluster") for i in range(2)) == sorted(
            clusters
        )
        assert "cuda:0" in verified.nth(0).inner_text()
        assert "2026-11-28 10:00 UTC" in verified.nth(0).inner_text()
        assert row(f"{families[0]}-ckpt0").get_attribute("data-verified") == clusters[1]

        gated = row(f"{families[1]}-ckpt1")
        assert gated.locator("td.gating").inner_text() == "gated request access"
        access = gated.locator("td.gating a").get_attribute("href")
        assert access == GATED_INFO["gated"]

        # Pushed as an older client would: unknown, not "open".
        legacy = row(f"{families[2]}-ckpt1")
        assert legacy.locator("td.licence").inner_text() == "unknown"
        assert legacy.locator("td.gating").inner_text() == "unknown"

        # Tampered on one cluster: shown like failed, with its reason as text.
        tampered_id = f"{families[2]}-ckpt3"
        tampered = row(tampered_id).locator(f'td.other li[data-cluster="{clusters[1]}"]')
        assert tampered.get_attribute("data-state") == "tampered"
        assert tampered.locator(".badge").get_attribute("class") == "badge s-tampered"
        assert TAMPERED.format(id=tampered_id) in tampered.inner_text()
        red = tampered.locator(".badge").evaluate("e => getComputedStyle(e).backgroundColor")
        failed = row("xss-ckpt").locator("td.other .badge").first
        assert failed.inner_text().startswith("failed")
        assert red == failed.evaluate("e => getComputedStyle(e).backgroundColor")

        shot = tmp_path / "catalogue.png"
        page.screenshot(path=str(shot), full_page=True)

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000
    assert dialogs == [], "a pushed value ran as script"
    assert errors == []
    _keep_screenshots(tmp_path, "catalogue.png")
