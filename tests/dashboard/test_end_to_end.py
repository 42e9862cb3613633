"""End to end: the real ``rootstock`` CLI pushing to a real dashboard.

A maintainer runs ``init`` with credentials, then ``install``, ``add`` and
``smoke-test --push-every 1`` against a live ``rootstock dashboard serve`` (uvicorn
subprocess, SQLite); the API and the coverage page then show the verified cells.
The dashboard is killed in the middle of a smoke-test (deterministically: one
checkpoint's ``setup()`` waits while a hold file exists), the run still ends with
exit code 0 and a warning, and a later ``rootstock manifest push`` catches up. A key
for another cluster gets a warning that names the cause.

The env is real (built by uv, verified by real workers running EMT); the module
shares one install and one dashboard of its own, because killing and restarting a
server must not disturb tests that share the session's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOTSTOCK, run_rootstock
from tests.dashboard.conftest import Dashboard, unique

pytestmark = pytest.mark.timeout(600)

CHECKPOINTS = ("e2e-a", "e2e-b", "e2e-c")
PUSH_ENV = {"ROOTSTOCK_PUSH_RETRY_CAP": "5", "ROOTSTOCK_PUSH_TIMEOUT": "3"}

GATED_ENV = '''\
"""Test env: three EMT checkpoints; e2e-b's setup() waits while a hold file exists."""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "ase>=3.23",
#     "numpy>=1.24",
# ]
# ///

CHECKPOINTS = {
    "e2e-a": "EMT",
    "e2e-b": "EMT, held while the hold file exists",
    "e2e-c": "EMT",
}
CHECKPOINT_INFO = {
    "e2e-a": {"licence": "LGPL-2.1-or-later", "citation": "10.1088/1361-648X/aa680e"},
}
HOLD_FILE = @HOLD@
HOLD_LIMIT_S = 120


def download(checkpoint, **kw):
    """Nothing to fetch."""
    return None


def setup(checkpoint, device="cuda", **kw):
    """EMT; e2e-b first waits for the test to remove the hold file (bounded)."""
    import os
    import time

    from ase.calculators.emt import EMT

    if checkpoint == "e2e-b":
        deadline = time.monotonic() + HOLD_LIMIT_S
        while os.path.exists(HOLD_FILE) and time.monotonic() < deadline:
            time.sleep(0.1)
    return EMT()
'''


@dataclass
class Site:
    """One maintained install, its dashboard and the maintainer's config."""

    dashboard: Dashboard
    root: Path
    cluster: str
    env: dict[str, str]
    hold: Path
    install: subprocess.CompletedProcess
    adds: list[subprocess.CompletedProcess]

    def cli(self, *args: str, check: bool = True, env: dict | None = None):
        return run_rootstock(
            *args, "--root", self.root, env={**self.env, **(env or {})}, check=check, timeout=300
        )

    def api(self, path: str) -> dict:
        response = httpx.get(f"{self.dashboard.url}api/v1/{path}", timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def push_count(self) -> int:
        return len(self.api(f"clusters/{self.cluster}/pushes?limit=100")["pushes"])

    def coverage_cells(self) -> dict[str, dict]:
        doc = self.api(f"coverage?cluster={self.cluster}")
        return {
            row["checkpoint"]: row["cells"][self.cluster]
            for row in doc["checkpoints"]
            if row["checkpoint"] in CHECKPOINTS
        }

    def local_stamps(self) -> dict[str, str]:
        manifest = json.loads((self.root / "manifest.json").read_text())
        entries = manifest["envs"]["gated"]["checkpoints"]
        return {c: entries[c]["verifications"][self.cluster]["cpu"]["at"] for c in CHECKPOINTS}


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@pytest.fixture(scope="module")
def site(new_database, tmp_path_factory, shared_uv_cache) -> Site:
    """``init`` with credentials, then ``install`` and ``add`` of every checkpoint."""
    work = tmp_path_factory.mktemp("e2e")
    dashboard = Dashboard(new_database("sqlite"), work)
    dashboard.start()
    try:
        cluster = dashboard.add_cluster(unique("e2e"))
        key, secret = dashboard.issue_key(cluster, maintainer="ada@example.org")
        secret_file = work / "api-secret"
        secret_file.write_text(secret + "\n")
        env = {"ROOTSTOCK_CONFIG": str(work / "config.toml"), **PUSH_ENV}
        root = work / "root"
        run_rootstock(
            "init", "--root", root, "--cluster", cluster, "--yes",
            "--maintainer-name", "Ada", "--maintainer-email", "ada@example.org",
            "--api-url", dashboard.url, "--api-key", key, "--api-secret-file", secret_file,
            env=env, timeout=60,
        )  # fmt: skip
        (root / ".uv-cache").symlink_to(shared_uv_cache)
        hold = work / "hold"
        env_file = work / "gated.py"
        env_file.write_text(GATED_ENV.replace("@HOLD@", repr(str(hold))))
        installed = run_rootstock("install", env_file, "--root", root, env=env)
        adds = [
            run_rootstock("add", c, "--device", "cpu", "--root", root, env=env, timeout=300)
            for c in CHECKPOINTS
        ]
        yield Site(dashboard, root, cluster, env, hold, installed, adds)
    finally:
        dashboard.close()


def test_install_add_and_smoke_test_reach_the_dashboard(site):
    config = (Path(site.env["ROOTSTOCK_CONFIG"])).read_text()
    assert "is_maintainer = true" in config and "api_secret" in config
    # Every maintainer command pushed on its own, after saving the local manifest.
    assert f"pushed the {site.cluster} manifest" in site.install.stderr
    for add in site.adds:
        assert f"pushed the {site.cluster} manifest" in add.stderr, add.stderr
    before = site.push_count()
    assert before >= 1 + len(CHECKPOINTS)

    # Two jobs: results arrive from two threads, snapshots still go one at a time.
    smoke = site.cli("smoke-test", "--push-every", "1", "--jobs", "2", "--device", "cpu")
    assert "warning" not in smoke.stderr, smoke.stderr
    # At least the first snapshot (later ones may coalesce while one is in flight)
    # and the final push after the last result.
    assert site.push_count() >= before + 2

    stamps = site.local_stamps()
    cells = site.coverage_cells()
    assert set(cells) == set(CHECKPOINTS)
    for checkpoint, cell in cells.items():
        assert cell["state"] == "verified", cell
        assert cell["env"] == "gated"
        assert moment(cell["verified_at"]) == moment(stamps[checkpoint])

    page = httpx.get(site.dashboard.url, params={"family": "gated"}, timeout=10)
    assert page.status_code == 200
    assert site.cluster in page.text
    for checkpoint in CHECKPOINTS:
        row = re.search(
            rf'<tr class="checkpoint"[^>]*><th>{re.escape(checkpoint)}</th>(.*?)</tr>',
            page.text,
            re.DOTALL,
        )
        assert row, f"no row for {checkpoint} on the coverage page"
        assert 'class="s-verified"' in row.group(1), row.group(1)
        assert f"checked {cells[checkpoint]['verified_at']}" in row.group(1)

    # The catalogue: each checkpoint's info came from the installed env file's
    # CHECKPOINT_INFO through the real client's push.
    catalogue = {e["checkpoint"]: e for e in site.api("catalogue")["checkpoints"]}
    described = catalogue["e2e-a"]
    assert (described["licence"], described["gated"], described["citation"]) == (
        "LGPL-2.1-or-later",
        None,
        "10.1088/1361-648X/aa680e",
    )
    for checkpoint in CHECKPOINTS:
        entry = catalogue[checkpoint]
        assert entry["described"] is True  # e2e-b and e2e-c: described, nothing given
        assert entry["verified_on"] == [site.cluster]
        (place,) = entry["clusters"]
        assert [(d["device_kind"], d["state"]) for d in place["devices"]] == [("cpu", "verified")]
    assert catalogue["e2e-b"]["licence"] is None


def test_a_dashboard_killed_mid_run_is_a_warning_and_manifest_push_catches_up(site, tmp_path):
    old = site.local_stamps()
    before = site.push_count()
    site.hold.write_text("hold e2e-b\n")
    out, err = tmp_path / "smoke.out", tmp_path / "smoke.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [*ROOTSTOCK, "smoke-test", "--push-every", "1", "--device", "cpu",
             "--root", str(site.root)],
            env={**os.environ, **site.env},
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True,
        )  # fmt: skip
    try:
        # The snapshot after e2e-a arrives while e2e-b is held: then kill the server.
        deadline = time.monotonic() + 180
        while site.push_count() == before:
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "no snapshot push arrived"
            time.sleep(0.2)
        site.dashboard.kill()
        site.hold.unlink()
        code = proc.wait(timeout=300)
    finally:
        site.hold.unlink(missing_ok=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    warnings = err.read_text()
    assert code == 0, warnings
    assert "warning:" in warnings and "rootstock manifest push" in warnings, warnings
    assert "connection refused" in warnings, warnings
    # Every result is on disk, pushed or not.
    new = site.local_stamps()
    assert all(moment(new[c]) > moment(old[c]) for c in CHECKPOINTS), (old, new)

    site.dashboard.restart()  # same port, same database
    behind = site.coverage_cells()
    assert moment(behind["e2e-a"]["verified_at"]) == moment(new["e2e-a"])
    assert moment(behind["e2e-c"]["verified_at"]) == moment(old["e2e-c"])

    pushed = site.cli("manifest", "push", "--json")
    doc = json.loads(pushed.stdout)
    assert doc["ok"] and [r["cluster"] for r in doc["results"]] == [site.cluster]
    caught_up = site.coverage_cells()
    for checkpoint in CHECKPOINTS:
        assert caught_up[checkpoint]["state"] == "verified"
        assert moment(caught_up[checkpoint]["verified_at"]) == moment(new[checkpoint])


def test_a_key_for_another_cluster_is_a_warning_naming_the_cause(site, tmp_path):
    other = site.dashboard.add_cluster(unique("other"))
    key, secret = site.dashboard.issue_key(other)
    config = tmp_path / "config.toml"
    config.write_text(
        f'is_maintainer = true\napi_url = "{site.dashboard.url}"\n'
        f'api_key = "{key}"\napi_secret = "{secret}"\n'
    )
    env = {"ROOTSTOCK_CONFIG": str(config)}
    before = site.push_count()
    added = site.cli("add", "e2e-a", "--no-verify", env=env)
    assert added.returncode == 0
    assert f"not scoped to cluster '{site.cluster}' (403)" in added.stderr, added.stderr
    assert f"issue-key --cluster {site.cluster}" in added.stderr
    assert "rootstock manifest push" in added.stderr
    refused = site.cli("manifest", "push", check=False, env=env)
    assert refused.returncode == 1
    assert "not scoped to cluster" in refused.stderr and "Traceback" not in refused.stderr
    assert site.push_count() == before


def test_usage_push_reaches_the_usage_page_and_never_double_counts(site):
    spool = site.root / "usage"
    spool.mkdir(exist_ok=True)
    for i, user in enumerate(("0" * 32, "1" * 32)):
        record = {
            "version": 1,
            "env": "gated",
            "checkpoint": "e2e-a",
            "device": "cpu",
            "entry_point": "calculator",
            "start": f"2026-10-0{i + 1}T10:00:00Z",
            "duration_s": 2.0,
            "force_calls": 5,
            "user": user,
        }
        (spool / f"20261001T100000Z-{i}.json").write_text(json.dumps(record))
    for _ in range(2):  # a repeated push replaces the month's counts
        pushed = site.cli("usage", "push", "--json")
        doc = json.loads(pushed.stdout)
        assert doc["ok"] and doc["results"][0]["cluster"] == site.cluster
        assert doc["results"][0]["response"]["rows"] == 1
    page = httpx.get(f"{site.dashboard.url}usage", params={"month": "2026-10"}, timeout=10)
    assert page.status_code == 200
    row = re.search(r'<tr data-checkpoint="e2e-a">(.*?)</tr>', page.text, re.DOTALL)
    assert row, page.text
    # clusters, sessions, distinct users, force calls
    assert re.findall(r'<td class="num">(\d+)</td>', row.group(1)) == ["1", "2", "2", "10"]


class SilentStandIn:
    """A STAND-IN for a dashboard whose host drops every answer: it accepts connections
    (so a push is in flight) and never replies. The real server always answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return  # closed

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_ctrl_c_does_not_wait_for_a_snapshot_in_flight(site, tmp_path):
    silent = SilentStandIn()
    config = Path(site.env["ROOTSTOCK_CONFIG"]).read_text()
    config = config.replace(f'"{site.dashboard.url}"', f'"{silent.url}"')
    assert silent.url in config
    (tmp_path / "config.toml").write_text(config)
    # An hour per attempt and in all: a run that waited for the snapshot would outlast
    # this test's timeout by far.
    env = {
        **os.environ,
        **site.env,
        "ROOTSTOCK_CONFIG": str(tmp_path / "config.toml"),
        "ROOTSTOCK_PUSH_TIMEOUT": "3600",
        "ROOTSTOCK_PUSH_RETRY_CAP": "3600",
    }
    site.hold.write_text("hold e2e-b\n")
    err = tmp_path / "smoke.err"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [*ROOTSTOCK, "smoke-test", "--push-every", "1", "--device", "cpu",
             "--root", str(site.root)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True,
        )  # fmt: skip
    try:
        # The snapshot after e2e-a is in flight (and never answered) while e2e-b is held.
        deadline = time.monotonic() + 180
        while not silent.accepted:
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "no snapshot push was sent"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        site.hold.unlink(missing_ok=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the run and any worker it left behind
        proc.wait(10)
        silent.close()
    assert code == 130, err.read_text()
    assert "Interrupted" in err.read_text() or "Aborted" in err.read_text()
