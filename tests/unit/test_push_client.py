"""The dashboard push client: transport policy, payloads, and the CLI around them.

The server here is a STAND-IN for the dashboard: a plain ``http.server`` on loopback
that answers with scripted status codes and records every request. It exists so the
retry policy can meet exact sequences (503 twice, a hang, a dropped connection) that
the real dashboard never produces on purpose. The real dashboard is exercised in
``tests/dashboard/test_end_to_end.py``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from rootstock.cli.main import cli
from rootstock.errors import ConfigError, PushNotConfigured
from rootstock.install.config import save_config
from rootstock.install.envfile import source_hash
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    ensure_manifest,
    record_env_build,
    record_fetch,
    record_verification,
)
from rootstock.install.usage import user_hash
from rootstock.ops.http_client import Deadline, RetryPolicy, request_json
from rootstock.ops.push import Dashboard, dashboard_settings, push_manifest, push_usage
from rootstock.ops.snapshot_push import SnapshotPusher

pytestmark = pytest.mark.timeout(60)

FP = {"energy_per_atom": -3.9, "force_norm": 1.2, "stress": [0.1] * 6, "device_kind": "cpu"}
FAST = RetryPolicy(attempt_timeout=2.0, total_cap=5.0, first_delay=0.01, max_delay=0.05)


# --- the stand-in dashboard ------------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class StandIn:
    """Scripted answers, consumed in order; the last one repeats."""

    server: ThreadingHTTPServer
    script: list = field(default_factory=lambda: [200])
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def next_action(self):
        with self.lock:
            return self.script.pop(0) if len(self.script) > 1 else self.script[0]


def _handler(stand_in_ref: list) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _answer(self) -> None:
            stand_in: StandIn = stand_in_ref[0]
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            with stand_in.lock:
                stand_in.seen.append(Seen(self.command, self.path, dict(self.headers), body))
            action = stand_in.next_action()
            if action == "hang":
                time.sleep(1.5)
                action = 200
            if action == "trickle":
                # Headers at once, then a byte every 0.2 s: no single read ever times out.
                self.send_response(200)
                self.send_header("Content-Length", "40")
                self.end_headers()
                for _ in range(40):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
                return
            if action == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            status, payload = action if isinstance(action, tuple) else (action, None)
            if payload is None:
                payload = {"push_id": len(stand_in.seen)} if status < 300 else {"detail": "no"}
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_PUT = do_POST = do_GET = _answer

    return Handler


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    ref: list = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(ref))
    server.daemon_threads = True
    ref.append(StandIn(server))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield ref[0]
    server.shutdown()
    server.server_close()
    thread.join(5)


def free_port() -> int:
    """A loopback port with nothing listening on it (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dashboard(url: str, policy: RetryPolicy = FAST) -> Dashboard:
    return Dashboard(url=url, key="rk_test", secret="s3cret", policy=policy)


# --- transport policy ------------------------------------------------------------------------


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
    started = time.monotonic()
    outcome = request_json("PUT", stand_in.url + "/x", {}, policy=policy)
    elapsed = time.monotonic() - started
    assert outcome.status is None and "timed out" in outcome.error
    # The trickle lasts 8 s per request; the cap (plus one attempt's grace) ends it.
    assert elapsed < 4.0


def test_refused_connection_fails_fast_without_retrying():
    policy = RetryPolicy(attempt_timeout=2.0, total_cap=8.0, first_delay=1.0, max_delay=4.0)
    started = time.monotonic()
    outcome = request_json("PUT", f"http://127.0.0.1:{free_port()}/x", {}, policy=policy)
    elapsed = time.monotonic() - started
    assert outcome.status is None and outcome.attempts == 1
    assert "refused" in outcome.error
    # Behaviour, not speed: a retrying client would sleep at least 0.5 s per retry and
    # keep going until the 8 s cap; this one must not wait out any part of it.
    assert elapsed < policy.total_cap / 4


def test_total_cap_bounds_retries_against_a_server_that_always_fails(stand_in):
    stand_in.script = [503]
    policy = RetryPolicy(attempt_timeout=1.0, total_cap=1.0, first_delay=0.05, max_delay=0.2)
    started = time.monotonic()
    outcome = request_json("PUT", stand_in.url + "/x", {}, policy=policy)
    elapsed = time.monotonic() - started
    assert outcome.status == 503 and outcome.attempts > 1
    assert len(stand_in.seen) == outcome.attempts
    # The cap is the point of the policy: it gives up instead of sleeping past it.
    assert elapsed < policy.total_cap + 0.5


def test_backoff_sleeps_stay_inside_the_cap_and_grow(stand_in):
    """A fake clock advanced only by sleeps: the schedule itself, deterministically."""
    stand_in.script = [503]
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    policy = RetryPolicy(attempt_timeout=1.0, total_cap=10.0, first_delay=0.5, max_delay=4.0)
    deadline = Deadline(policy.total_cap, clock=lambda: now[0])
    outcome = request_json("PUT", stand_in.url, {}, policy=policy, deadline=deadline, sleep=sleep)
    assert outcome.status == 503
    assert sum(slept) <= policy.total_cap
    assert len(slept) == outcome.attempts - 1 >= 3
    assert all(0.25 <= s <= 4.0 for s in slept)
    assert slept[2] > slept[0]  # doubling outruns the jitter after two steps


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


def test_a_dead_dashboard_is_tried_once_for_all_clusters(shared_install):
    report = push_manifest(shared_install, dashboard=dashboard(f"http://127.0.0.1:{free_port()}"))
    assert not report.ok
    assert [r.attempts for r in report.results] == [1, 0]
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


def test_usage_push_sends_counts_and_never_user_hashes(stand_in, tmp_path):
    layout = InstallLayout(root=tmp_path, cache_root=tmp_path)
    layout.usage_dir.mkdir(parents=True)
    hashes = [user_hash(b"0" * 32, name) for name in ("ann", "bob")]
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


# --- snapshots -------------------------------------------------------------------------------


def test_snapshot_requests_coalesce_while_a_push_is_in_flight():
    release = threading.Event()
    calls: list[int] = []

    def push():
        calls.append(1)
        release.wait(10)
        from rootstock.ops.push import PushReport

        return PushReport("manifest", "http://stand-in")

    pusher = SnapshotPusher(push)
    pusher.request()
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(5):
        pusher.request()  # returns at once although a push is blocked
    release.set()
    while len(pusher.reports) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    pusher.request()
    pusher.close()  # drops the pending request: the caller's final push covers it
    assert len(calls) in (2, 3)
    assert len(calls) == len(pusher.reports)
    pusher.request()  # after close: ignored
    assert len(calls) == len(pusher.reports)


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
