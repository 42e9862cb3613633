"""The dashboard's pages in a real browser: Debian's chromium driven by Playwright.

A real ``rootstock dashboard serve`` on loopback (SQLite) is filled through its API,
then chromium loads the coverage matrix, filters it to one family with the form,
follows a cluster's column link and reads the history table. A pushed env name of
``<script>alert(1)</script>`` must stay text: no dialog may open. Playwright never
downloads a browser here: it is pointed at ``/usr/bin/chromium``.
"""

from __future__ import annotations

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
            if index == 0:
                # a second, older record: the history table then has two rows for it
                first = manifest(cluster, {families[0]: {f"{families[0]}-ckpt1": {
                    "gpu": record(families[0], "failed", at="2026-11-20T08:00:00+00:00",
                                  message="first try failed")}}})  # fmt: skip
                _push(dashboard, cluster, first)
            _push(dashboard, cluster, manifest(cluster, envs))
        yield {"dashboard": dashboard, "families": families, "clusters": clusters}
    finally:
        dashboard.close()


def _push(dashboard: Dashboard, cluster: str, body: dict) -> None:
    headers = bearer(*dashboard.issue_key(cluster))
    response = httpx.put(
        f"{dashboard.url}api/v1/clusters/{cluster}/manifest", json=body, headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text


def test_filter_open_a_cluster_and_read_its_history(browser_site, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install 'rootstock[test]')")
    dashboard = browser_site["dashboard"]
    family = browser_site["families"][1]
    cluster = browser_site["clusters"][0]
    profile = tmp_path / "chromium-profile"  # a fresh user-data-dir
    profile.mkdir()
    dialogs: list[str] = []
    errors: list[str] = []

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
        finally:
            context.close()

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000
    assert dialogs == [], "a pushed value ran as script"
    assert errors == []
    keep = os.environ.get("ROOTSTOCK_TEST_SCREENSHOTS")
    if keep:  # for a person to look at; CI can collect them as artifacts
        Path(keep).mkdir(parents=True, exist_ok=True)
        for png in ("coverage.png", "cluster.png"):
            shutil.copy(tmp_path / png, Path(keep) / png)
