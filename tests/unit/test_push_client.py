"""The dashboard push client: transport policy, payloads, and the CLI around them.

The server here is a STAND-IN for the dashboard (``push_stand_in``): a plain
``http.server`` on loopback that answers with scripted status codes and records every
request, so the retry policy can meet exact sequences the real dashboard never
produces on purpose. The real dashboard is exercised in
``tests/dashboard/test_end_to_end.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from rootstock.cli.main import cli
from rootstock.errors import ConfigError, PushNotConfigured
from rootstock.install.config import config_path, save_config
from rootstock.install.envfile import source_hash
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    ensure_manifest,
    record_env_build,
    record_fetch,
    record_verification,
)
from rootstock.ops.http_client import Deadline, RetryPolicy, request_json
from rootstock.ops.push import (
    Dashboard,
    dashboard_settings,
    manifest_payloads,
    push_manifest,
    push_usage,
)
from tests.unit.push_stand_in import StandIn, free_port, serve

pytestmark = pytest.mark.timeout(60)

FP = {"energy_per_atom": -3.9, "force_norm": 1.2, "stress": [0.1] * 6, "device_kind": "cpu"}
FAST = RetryPolicy(attempt_timeout=2.0, total_cap=5.0, first_delay=0.01, max_delay=0.05)


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    yield from serve()


@pytest.fixture
def elsewhere() -> Iterator[StandIn]:
    """A second stand-in on another loopback port: where a redirect points."""
    yield from serve()


def dashboard(url: str, policy: RetryPolicy = FAST) -> Dashboard:
    return Dashboard(url=url, key="rk_test", secret="s3cret", policy=policy)


# --- transport policy ------------------------------------------------------------------------


class FakeClock:
    """A clock that only sleeps move: retry schedules checked without waiting them out."""

    def __init__(self) -> None:
        self.time = 0.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.time += seconds


def test_retries_503_then_succeeds(stand_in):
    stand_in.script = [503, 503, (200, {"push_id": 9})]
    outcome = request_json("PUT", stand_in.url + "/x", {"a": 1}, policy=FAST)
    assert outcome.ok and outcome.status == 200 and outcome.attempts == 3
    assert outcome.json() == {"push_id": 9}
    assert len(stand_in.seen) == 3
    assert all(s.json() == {"a": 1} for s in stand_in.seen)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
def test_client_errors_are_never_retried(stand_in, status):
    stand_in.script = [status, 200]
    outcome = request_json("PUT", stand_in.url + "/x", {}, policy=FAST)
    assert outcome.status == status and outcome.attempts == 1
    assert len(stand_in.seen) == 1


def test_a_timeout_and_a_dropped_connection_are_retried(stand_in):
    stand_in.script = ["hang", "drop", 200]
    policy = RetryPolicy(attempt_timeout=0.5, total_cap=10.0, first_delay=0.01, max_delay=0.05)
    outcome = request_json("PUT", stand_in.url + "/x", {}, policy=policy)
    assert outcome.ok and outcome.attempts == 3


def test_a_server_that_trickles_cannot_outlast_the_cap(stand_in):
    stand_in.script = ["trickle"]
    policy = RetryPolicy(attempt_timeout=0.5, total_cap=1.0, first_delay=0.05, max_delay=0.1)
    outcome = request_json("PUT", stand_in.url + "/x", {}, policy=policy)
    # Each read gets a byte in time, and the whole answer (8 s) would be a 200: only
    # abandoning the attempt at its timeout gives "timed out" instead.
    assert outcome.status is None and "timed out" in outcome.error


def test_refused_connection_is_retried_once_without_backoff():
    policy = RetryPolicy(attempt_timeout=2.0, total_cap=8.0, first_delay=1.0, max_delay=4.0)
    slept: list[float] = []
    outcome = request_json(
        "PUT", f"http://127.0.0.1:{free_port()}/x", {}, policy=policy, sleep=slept.append
    )
    assert outcome.status is None and outcome.attempts == 2
    assert "refused" in outcome.error
    # Nothing is listening: one short wait (tests/unit/test_http_retry.py), no backoff.
    assert slept == [policy.refused_delay]


def test_total_cap_bounds_retries_against_a_server_that_always_fails(stand_in):
    """A fake clock advanced only by sleeps: the cap ends the retries, not the server."""
    stand_in.script = [503]
    clock = FakeClock()
    policy = RetryPolicy(attempt_timeout=1.0, total_cap=1.0, first_delay=0.05, max_delay=0.2)
    deadline = Deadline(policy.total_cap, clock=clock.now)
    outcome = request_json(
        "PUT", stand_in.url, {}, policy=policy, deadline=deadline, sleep=clock.sleep
    )
    assert outcome.status == 503 and outcome.attempts > 1
    assert len(stand_in.seen) == outcome.attempts
    # It gives up instead of sleeping past the cap.
    assert sum(clock.slept) <= policy.total_cap


def test_a_spent_deadline_sends_nothing(stand_in, shared_install):
    """The final push after a snapshot shares the snapshot's deadline (smoke-test)."""
    spent = Deadline(0.0, clock=lambda: 100.0)
    report = push_manifest(shared_install, ["alpha"], dashboard(stand_in.url), spent)
    assert stand_in.seen == []
    (result,) = report.results
    assert not result.ok and result.attempts == 0
    assert "retry cap" in result.message and "rootstock manifest push" in result.hint


# --- redirects -------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_failure_that_names_its_target(stand_in, elsewhere, shared_install, status):
    """Following would resend the credential to another host, and may land on a 200."""
    target = elsewhere.url + "/api/v1/clusters/alpha/manifest"
    stand_in.script = [("redirect", status, target)]
    elsewhere.script = [200]
    report = push_manifest(shared_install, ["alpha"], dashboard(stand_in.url))
    assert elsewhere.seen == []  # no request at all, so no Authorization either
    assert len(stand_in.seen) == 1  # a 3xx is final: not retried
    assert not report.ok
    (result,) = report.results
    assert result.status == status and target in result.message
    assert result.hint.endswith(f"set api_url in {config_path()} to {elsewhere.url}")


def test_a_usage_post_redirected_to_a_landing_page_fails(stand_in, elsewhere, tmp_path):
    """urllib would turn the POST into a GET and call the landing page a success."""
    layout, _hashes = _usage_install(tmp_path)
    stand_in.script = [("redirect", 302, elsewhere.url + "/login?next=/")]
    report = push_usage(layout, dashboard=dashboard(stand_in.url))
    assert elsewhere.seen == []
    assert not report.ok
    text = str(report.error())
    assert f"{elsewhere.url}/login?next=/" in text and "set api_url" in text


def test_a_relative_redirect_is_reported_absolute(stand_in, shared_install):
    stand_in.script = [("redirect", 308, "/moved")]
    report = push_manifest(shared_install, ["alpha"], dashboard(stand_in.url))
    assert len(stand_in.seen) == 1
    assert f"{stand_in.url}/moved" in report.results[0].message
    assert "set api_url" in report.results[0].hint


def test_the_secret_stays_out_of_repr():
    text = repr(dashboard("http://127.0.0.1:1"))
    assert "rk_test" in text and "s3cret" not in text


def test_backoff_sleeps_stay_inside_the_cap_and_grow(stand_in):
    """A fake clock advanced only by sleeps: the schedule itself, deterministically."""
    stand_in.script = [503]
    clock = FakeClock()
    policy = RetryPolicy(attempt_timeout=1.0, total_cap=10.0, first_delay=0.5, max_delay=4.0)
    deadline = Deadline(policy.total_cap, clock=clock.now)
    outcome = request_json(
        "PUT", stand_in.url, {}, policy=policy, deadline=deadline, sleep=clock.sleep
    )
    assert outcome.status == 503
    assert sum(clock.slept) <= policy.total_cap
    assert len(clock.slept) == outcome.attempts - 1 >= 3
    assert all(0.25 <= s <= 4.0 for s in clock.slept)
    assert clock.slept[2] > clock.slept[0]  # doubling outruns the jitter after two steps


def test_retry_after_is_honoured(stand_in):
    stand_in.script = [429, 200]
    slept: list[float] = []
    stand_in_answer = stand_in.server.RequestHandlerClass
    original = stand_in_answer.send_header

    def with_retry_after(self, name, value):
        original(self, name, value)
        if name == "Content-Type" and len(stand_in.seen) == 1:
            original(self, "Retry-After", "1")

    stand_in_answer.send_header = with_retry_after
    outcome = request_json("PUT", stand_in.url, {}, policy=FAST, sleep=slept.append)
    assert outcome.ok and slept == [1.0]


def test_policy_from_environment_and_config():
    policy = RetryPolicy.from_settings(
        {"push_timeout": 3, "push_retry_cap": 12}, {"ROOTSTOCK_PUSH_RETRY_CAP": "2.5"}
    )
    assert (policy.attempt_timeout, policy.total_cap) == (3.0, 2.5)
    with pytest.raises(ConfigError, match="ROOTSTOCK_PUSH_TIMEOUT"):
        RetryPolicy.from_settings({}, {"ROOTSTOCK_PUSH_TIMEOUT": "soon"})


# --- configuration ---------------------------------------------------------------------------


def test_missing_credentials_name_the_fix():
    with pytest.raises(PushNotConfigured) as info:
        dashboard_settings({"api_url": "http://x", "api_key": "k"})
    assert "api_secret" in info.value.message and "api_key" not in info.value.message
    assert "rootstock init" in info.value.hint
    with pytest.raises(ConfigError, match="not an http"):
        dashboard_settings({"api_url": "dashboard:8000", "api_key": "k", "api_secret": "s"})


# --- payloads --------------------------------------------------------------------------------


@pytest.fixture
def shared_install(tmp_path: Path) -> InstallLayout:
    """A shared install serving two clusters, each with its own verification."""
    layout = InstallLayout(root=tmp_path / "root", cache_root=tmp_path / "root")
    layout.root.mkdir()
    ensure_manifest(layout, ["alpha", "beta"])
    source = layout.env_source("emt")
    source.parent.mkdir(parents=True)
    source.write_text("CHECKPOINTS = {'emt': 'x'}\n")
    record_env_build(layout, "emt", {"source_hash": source_hash(source.read_text())})
    record_fetch(layout, "emt", "emt")
    for cluster in ("alpha", "beta"):
        record_verification(
            layout, "emt", "emt", cluster, {"passed": True, "device": "cpu", "fingerprint": FP}
        )
    return layout


def test_one_payload_per_cluster_with_only_its_verifications(stand_in, shared_install):
    hotfix = "CHECKPOINTS = {'emt': 'x'}  # hotfixed\n"
    shared_install.env_source("emt").write_text(hotfix)
    before = shared_install.manifest_file.read_bytes()
    report = push_manifest(shared_install, dashboard=dashboard(stand_in.url))
    assert report.ok, report.to_dict()
    assert [r.cluster for r in report.results] == ["alpha", "beta"]
    by_path = {s.path: s for s in stand_in.seen}
    assert set(by_path) == {
        "/api/v1/clusters/alpha/manifest",
        "/api/v1/clusters/beta/manifest",
    }
    for cluster in ("alpha", "beta"):
        sent = by_path[f"/api/v1/clusters/{cluster}/manifest"]
        assert sent.method == "PUT"
        assert sent.headers["Authorization"] == "Bearer rk_test:s3cret"
        body = sent.json()
        assert body["clusters"] == [cluster]
        entry = body["envs"]["emt"]["checkpoints"]["emt"]
        assert set(entry["verifications"]) == {cluster}
        # The live hash travels, so the dashboard sees the unverified hotfix as stale.
        assert body["envs"]["emt"]["source_hash"] == source_hash(hotfix)
    # A push only reads: the local manifest is byte-for-byte what it was.
    assert shared_install.manifest_file.read_bytes() == before
    assert report.to_dict()["results"][0]["response"] == {"push_id": 1}


def test_each_checkpoint_carries_its_env_file_s_info(shared_install):
    shared_install.env_source("emt").write_text(
        "def setup(model, device='cpu'):\n    return None\n\n"
        "CHECKPOINTS = {'emt': 'x', 'emt-2': 'y'}\n"
        "CHECKPOINT_INFO = {'emt': {'licence': 'LGPL-2.1-or-later', 'citation': "
        "'10.1088/1361-648X/aa680e', 'summary': 'not pushed'}}\n"
    )
    record_fetch(shared_install, "emt", "emt-2")
    payloads = manifest_payloads(shared_install)
    for payload in payloads.values():
        checkpoints = payload["envs"]["emt"]["checkpoints"]
        assert checkpoints["emt"]["info"] == {  # type: ignore[typeddict-item]
            "licence": "LGPL-2.1-or-later",
            "gated": None,
            "citation": "10.1088/1361-648X/aa680e",
        }
        # Declared without CHECKPOINT_INFO: described, with nothing known.
        assert checkpoints["emt-2"]["info"] == dict.fromkeys(  # type: ignore[typeddict-item]
            ("licence", "gated", "citation")
        )
    # The local manifest never holds it.
    assert b'"info"' not in shared_install.manifest_file.read_bytes()


def test_a_broken_env_file_sends_no_info(shared_install):
    shared_install.env_source("emt").write_text("CHECKPOINTS = {'emt': \n")
    for payload in manifest_payloads(shared_install).values():
        assert "info" not in payload["envs"]["emt"]["checkpoints"]["emt"]


def test_a_dead_dashboard_is_tried_once_for_all_clusters(shared_install):
    report = push_manifest(shared_install, dashboard=dashboard(f"http://127.0.0.1:{free_port()}"))
    assert not report.ok
    assert [r.attempts for r in report.results] == [2, 0]
    assert "refused" in report.results[0].message
    assert "not sent" in report.results[1].message
    assert "rootstock manifest push" in report.results[1].hint


@pytest.mark.parametrize(
    ("status", "words"),
    [
        (401, ["check api_key and api_secret"]),
        (403, ["not scoped to cluster 'alpha'", "issue-key --cluster alpha"]),
        (413, ["larger than the dashboard accepts"]),
        (422, ["rejected the manifest", "body.clusters: bad"]),
    ],
)
def test_refusals_name_their_cause(stand_in, shared_install, status, words):
    detail = [{"loc": ["body", "clusters"], "msg": "bad"}] if status == 422 else "refused"
    stand_in.script = [(status, {"detail": detail})]
    report = push_manifest(shared_install, ["alpha"], dashboard(stand_in.url))
    assert not report.ok and len(stand_in.seen) == 1
    text = str(report.error())
    for word in words:
        assert word in text


def test_a_404_naming_the_cluster_means_it_was_removed(stand_in, shared_install):
    # The real dashboard's answer to a write for a cluster it no longer has.
    stand_in.script = [(404, {"detail": "the dashboard has no cluster 'alpha'"})]
    report = push_manifest(shared_install, ["alpha"], dashboard(stand_in.url))
    text = str(report.error())
    assert "no cluster 'alpha'" in text and "add-cluster alpha" in text
    assert "no dashboard API" not in text
    # Anything else at that path (FastAPI's own 404, a web server's page) is a wrong URL.
    stand_in.script = [(404, {"detail": "Not Found"})]
    report = push_manifest(shared_install, ["alpha"], dashboard(stand_in.url))
    assert "no dashboard API at this address" in str(report.error())


def _usage_install(tmp_path: Path) -> tuple[InstallLayout, list[str]]:
    """An install for cluster alpha with three usage records of two users."""
    layout = InstallLayout(root=tmp_path, cache_root=tmp_path)
    layout.usage_dir.mkdir(parents=True)
    hashes = ["a1" * 16, "b2" * 16]  # two users' ids
    for i, user in enumerate([hashes[0], hashes[1], hashes[0]]):
        record = {
            "version": 1,
            "env": "emt",
            "checkpoint": "emt",
            "device": "cpu",
            "entry_point": "calculator",
            "start": f"2026-11-0{i + 1}T10:00:00Z",
            "duration_s": 1.0,
            "force_calls": 4,
            "user": user,
        }
        (layout.usage_dir / f"r{i}.json").write_text(json.dumps(record))
    ensure_manifest(layout, ["alpha"])
    return layout, hashes


def test_usage_push_sends_counts_and_never_user_hashes(stand_in, tmp_path):
    layout, hashes = _usage_install(tmp_path)
    report = push_usage(layout, dashboard=dashboard(stand_in.url))
    assert report.ok
    (sent,) = stand_in.seen
    assert (sent.method, sent.path) == ("POST", "/api/v1/clusters/alpha/usage")
    assert sent.json() == {
        "version": 1,
        "counts": [
            {
                "month": "2026-11",
                "env": "emt",
                "checkpoint": "emt",
                "sessions": 3,
                "distinct_users": 2,
                "force_calls": 12,
            }
        ],
    }
    assert not any(h.encode() in sent.body for h in hashes)


# --- the CLI ---------------------------------------------------------------------------------


@pytest.fixture
def maintainer(tmp_path, monkeypatch, stand_in):
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("ROOTSTOCK_PUSH_RETRY_CAP", "2")
    save_config(
        {
            "is_maintainer": True,
            "api_url": stand_in.url + "/",
            "api_key": "rk_test",
            "api_secret": "s3cret",
        }
    )
    return stand_in


def test_manifest_push_json_and_failure_exit_code(maintainer, shared_install):
    runner = CliRunner()
    root = ["--root", str(shared_install.root)]
    out = runner.invoke(cli, ["manifest", "push", "--json", *root])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["ok"] and [r["cluster"] for r in doc["results"]] == ["alpha", "beta"]
    assert set(doc) == {"what", "api_url", "ok", "results"}
    maintainer.script = [403]
    out = runner.invoke(cli, ["manifest", "push", "--cluster", "beta", *root])
    assert out.exit_code == 1
    assert "not scoped to cluster 'beta'" in str(out.exception)
    assert maintainer.seen[-1].path == "/api/v1/clusters/beta/manifest"


def test_auto_push_after_manifest_init_and_no_push(maintainer, shared_install):
    runner = CliRunner()
    root = ["--root", str(shared_install.root)]
    out = runner.invoke(cli, ["manifest", "init", "--cluster", "alpha", "--no-push", *root])
    assert out.exit_code == 0 and maintainer.seen == []
    out = runner.invoke(cli, ["manifest", "init", "--cluster", "gamma", *root])
    assert out.exit_code == 0, out.output
    assert {s.path.split("/")[4] for s in maintainer.seen} == {"alpha", "beta", "gamma"}
    assert "pushed the gamma manifest" in out.stderr


def test_failed_auto_push_is_a_warning_naming_the_retry(maintainer, shared_install):
    maintainer.script = [503]
    out = CliRunner().invoke(
        cli, ["manifest", "init", "--cluster", "alpha", "--root", str(shared_install.root)]
    )
    assert out.exit_code == 0, out.output
    assert "warning:" in out.stderr and "retry with `rootstock manifest push`" in out.stderr
    assert "updated" in out.stdout  # the local manifest was saved first
