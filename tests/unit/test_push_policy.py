"""When a command pushes, and the lines it shows about it (:mod:`rootstock.ops.push_policy`).

The decision and the wording live in ``ops/``; ``cli/push_hooks`` only prints them.
The dashboard here is the loopback STAND-IN of ``push_stand_in`` (scripted answers);
the real dashboard is exercised in ``tests/dashboard/test_end_to_end.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.cli.push_hooks import show_notice
from rootstock.install.config import save_config
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import ensure_manifest
from rootstock.ops.http_client import Deadline, RetryPolicy
from rootstock.ops.push import Dashboard
from rootstock.ops.push_policy import (
    PushNotice,
    decide_push,
    push_after_command,
    snapshot_pushes,
)
from tests.unit.push_stand_in import StandIn, free_port, serve

pytestmark = pytest.mark.timeout(60)

FAST = RetryPolicy(attempt_timeout=2.0, total_cap=3.0, first_delay=0.01, max_delay=0.05)
CREDENTIALS = {"api_url": "http://127.0.0.1:9", "api_key": "rk_test", "api_secret": "s3cret"}


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    yield from serve()


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "config.toml"
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(path))
    return path


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    layout = InstallLayout(root=tmp_path / "root", cache_root=tmp_path / "root")
    layout.root.mkdir()
    ensure_manifest(layout, ["alpha", "beta"])
    return layout


def dashboard(url: str) -> Dashboard:
    return Dashboard(url=url, key="rk_test", secret="s3cret", policy=FAST)


def wait_for(condition, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


# --- the decision ------------------------------------------------------------------------


def test_no_push_pushes_nothing_and_says_push_every_is_ignored(config):
    save_config({"is_maintainer": True, **CREDENTIALS})
    assert decide_push(True).dashboard is None
    assert decide_push(True).warnings == []
    asked = decide_push(True, asked_by="--push-every")
    assert asked.dashboard is None
    assert asked.warnings == ["--push-every is ignored with --no-push"]


def test_a_maintainer_with_credentials_pushes_and_a_user_does_not(config):
    save_config({"is_maintainer": True, **CREDENTIALS})
    decision = decide_push(False)
    assert decision.dashboard is not None and decision.warnings == []
    assert (decision.dashboard.url, decision.dashboard.key) == ("http://127.0.0.1:9", "rk_test")
    save_config({"is_maintainer": False, **CREDENTIALS})
    assert decide_push(False).dashboard is None and decide_push(False).warnings == []
    # An option that asks for pushes needs the credentials only, not the maintainer flag.
    assert decide_push(False, asked_by="--push-every").dashboard is not None


def test_missing_credentials_warn_only_when_pushes_were_wanted(config):
    save_config({"is_maintainer": True})
    # A maintainer with no dashboard at all is left alone.
    assert decide_push(False).dashboard is None and decide_push(False).warnings == []
    save_config({"is_maintainer": True, "api_url": "http://127.0.0.1:9"})
    (warning,) = decide_push(False).warnings
    assert warning.startswith("not pushing to the dashboard: api_key, api_secret missing from ")
    assert str(config) in warning and "results are only saved locally" in warning
    save_config({})
    (warning,) = decide_push(False, asked_by="--push-every").warnings
    assert "api_url, api_key, api_secret missing" in warning


def test_an_unreadable_config_is_a_warning_not_an_error(config):
    config.write_text("is_maintainer = [unclosed\n")
    decision = decide_push(False)
    assert decision.dashboard is None
    (warning,) = decision.warnings
    assert warning.startswith("not pushing to the dashboard: ")
    assert "is not a valid config file" in warning


# --- the push after a command ------------------------------------------------------------


def test_no_dashboard_sends_nothing(stand_in, layout):
    pushed = push_after_command("add", layout, None, ["alpha"])
    assert pushed.report is None and pushed.notices == []
    assert stand_in.seen == []


def test_a_pushed_cluster_is_one_plain_line(stand_in, layout):
    stand_in.script = [(200, {"push_id": 7})]
    pushed = push_after_command("add", layout, dashboard(stand_in.url), ["alpha"])
    assert pushed.report is not None and pushed.report.ok
    assert pushed.notices == [PushNotice(f"pushed the alpha manifest to {stand_in.url} (push 7)")]
    assert [s.path for s in stand_in.seen] == ["/api/v1/clusters/alpha/manifest"]


def test_a_refused_push_is_a_warning_naming_the_fix_and_the_retry(stand_in, layout):
    stand_in.script = [401]
    pushed = push_after_command("install", layout, dashboard(stand_in.url), ["alpha"])
    assert pushed.report is not None and not pushed.report.ok
    (notice,) = pushed.notices
    assert notice.warning
    assert notice.text.startswith(f"install: pushing cluster alpha to {stand_in.url} failed: ")
    assert "refused the credentials (401)" in notice.text
    assert "retry with `rootstock manifest push`" in notice.text
    assert "\n  hint: check api_key and api_secret" in notice.text


def test_clusters_never_tried_join_the_warning_of_the_unreachable_one(layout):
    unreachable = f"http://127.0.0.1:{free_port()}"
    pushed = push_after_command("smoke-test", layout, dashboard(unreachable))
    (notice,) = pushed.notices
    assert notice.warning
    assert notice.text.startswith(f"smoke-test: pushing clusters alpha, beta to {unreachable}")


def test_a_manifest_that_cannot_be_read_is_a_warning(stand_in, layout):
    layout.manifest_file.write_text("{not json")
    pushed = push_after_command("add", layout, dashboard(stand_in.url), ["alpha"])
    assert pushed.report is None
    (notice,) = pushed.notices
    assert notice.warning
    assert notice.text.startswith("add: the manifest is saved locally but was not pushed (")
    assert notice.text.endswith("retry with `rootstock manifest push`")
    assert stand_in.seen == []


def test_the_cli_prints_warnings_with_the_prefix_and_news_without(capsys):
    show_notice(PushNotice("pushed the alpha manifest to http://x"))
    show_notice(PushNotice("add: pushing cluster alpha failed", warning=True))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "pushed the alpha manifest to http://x\nwarning: add: pushing cluster alpha failed\n"
    )


# --- smoke-test --push-every ---------------------------------------------------------------


def test_no_snapshots_without_a_dashboard_or_an_interval(stand_in, layout):
    with snapshot_pushes(layout, None, "alpha", 2, lambda _n: None) as snapshots:
        assert snapshots is None
    with snapshot_pushes(layout, dashboard(stand_in.url), "alpha", None, print) as snapshots:
        assert snapshots is None
    assert stand_in.seen == []


def test_a_snapshot_pushes_the_cluster_view_and_reports_through_the_callback(stand_in, layout):
    stand_in.script = [(200, {"push_id": 1})]
    notices: list[PushNotice] = []
    with snapshot_pushes(layout, dashboard(stand_in.url), "beta", 2, notices.append) as snaps:
        assert snaps is not None
        snaps.on_snapshot(2)
        wait_for(lambda: len(notices) == 1)
        deadline = snaps.finish()
    assert isinstance(deadline, Deadline)
    assert 0 < deadline.remaining() <= FAST.total_cap
    assert [s.path for s in stand_in.seen] == ["/api/v1/clusters/beta/manifest"]
    assert notices == [PushNotice(f"pushed the beta manifest to {stand_in.url} (push 1)")]


def test_a_snapshot_failure_repeated_with_the_same_cause_is_reported_once(stand_in, layout):
    stand_in.script = [401]
    notices: list[PushNotice] = []
    with snapshot_pushes(layout, dashboard(stand_in.url), "alpha", 1, notices.append) as snaps:
        assert snaps is not None
        snaps.on_snapshot(1)
        wait_for(lambda: len(stand_in.seen) == 1 and len(snaps.pusher.reports) == 1)
        snaps.on_snapshot(2)
        wait_for(lambda: len(snaps.pusher.reports) == 2)
        snaps.finish()
    (notice,) = notices
    assert notice.warning
    assert notice.text.startswith("smoke-test --push-every: pushing cluster alpha")
