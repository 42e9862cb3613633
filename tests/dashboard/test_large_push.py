"""Large pushes get the dashboard's real answer (401, 403, 413) at once, not a reset.

The dashboard answers a refused write before reading its body. Two things keep that
answer from being lost when the body is megabytes long:

* the server drains the refused body (bounded) after answering, so even a client
  that sends its whole body before reading gets the answer instead of a reset;
* the push client watches for an answer while it sends, and stops sending once one
  has arrived, so it reads the answer even past the server's drain bound.

The server side is tested with a raw socket that sends everything first (a naive
client), against a dashboard whose body limit is larger than the body; the client
side through ``rootstock manifest push`` with a 5 MB manifest against the session's
dashboard, whose 1 MiB limit puts the body past its drain bound.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

from rootstock.cli.main import cli
from rootstock.install.config import save_config
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    ensure_manifest,
    load_manifest,
    record_fetch,
    record_verification,
    update_manifest,
)
from tests.dashboard.conftest import Dashboard, bearer, unique

pytestmark = pytest.mark.timeout(120)

BIG_LIMIT = 8 * 2**20
FP = {"energy_per_atom": -3.9, "force_norm": 1.2, "stress": [0.1] * 6, "device_kind": "cpu"}
# Before the fix each push took the whole retry cap (20 s here), ending "connection
# failed"; an answer read at once takes a fraction of a second, even on a loaded
# machine. The CLI's wall time also reads and serialises the 5 MB manifest.
QUICK_S = 5.0
CLI_WALL_S = 15.0


@pytest.fixture(scope="module")
def roomy_dashboard(new_database, tmp_path_factory) -> Iterator[Dashboard]:
    """A dashboard of this module's own whose body limit is above the bodies sent."""
    dashboard = Dashboard(
        new_database("sqlite"), tmp_path_factory.mktemp("large-push-logs"), max_body=BIG_LIMIT
    )
    try:
        yield dashboard.start()
    finally:
        dashboard.close()


def send_all_then_read(dashboard: Dashboard, path: str, headers: dict[str, str], size: int):
    """Send a request with a ``size``-byte body in full, then read the answer.

    A naive client: it never looks for an early answer, so a server that closes
    with the body unread makes ``sendall`` or ``recv`` fail with a reset.
    Returns ``(status, detail, seconds)``.
    """
    parts = urlsplit(dashboard.url)
    head = f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {size}\r\n\r\n"
    started = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port), timeout=20) as sock:
        sock.sendall(head.encode())
        sock.sendall(b" " * size)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _framed_length(data):
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    return status, json.loads(body)["detail"], time.monotonic() - started


def _framed_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            return len(head) + 4 + int(value)
    return len(data)


def test_a_naive_client_gets_401_for_a_large_body(roomy_dashboard):
    status, detail, seconds = send_all_then_read(
        roomy_dashboard,
        f"/api/v1/clusters/{unique()}/manifest",
        bearer("rk_nosuchkey", "wrong"),
        6 * 2**20,
    )
    assert status == 401 and detail
    assert seconds < QUICK_S


def test_a_naive_client_gets_403_for_a_large_body(roomy_dashboard):
    _mine, auth = roomy_dashboard.cluster_with_key()
    other = roomy_dashboard.add_cluster(unique("other"))
    status, detail, seconds = send_all_then_read(
        roomy_dashboard, f"/api/v1/clusters/{other}/manifest", auth, 6 * 2**20
    )
    assert status == 403 and other in detail
    assert seconds < QUICK_S


def test_a_naive_client_gets_413_for_a_body_over_the_limit(roomy_dashboard):
    cluster, auth = roomy_dashboard.cluster_with_key()
    status, detail, seconds = send_all_then_read(
        roomy_dashboard, f"/api/v1/clusters/{cluster}/manifest", auth, BIG_LIMIT + 2 * 2**20
    )
    assert status == 413 and str(BIG_LIMIT) in detail
    assert seconds < QUICK_S


# --- rootstock manifest push with a large manifest -------------------------------------------


@pytest.fixture(scope="module")
def big_install(tmp_path_factory) -> InstallLayout:
    """An install whose manifest view for its cluster is over 4 MB."""
    root = tmp_path_factory.mktemp("big-install") / "root"
    layout = InstallLayout(root=root, cache_root=root)
    root.mkdir()
    cluster = "bigcluster"
    ensure_manifest(layout, [cluster])
    record_fetch(layout, "emt", "emt")
    record_verification(
        layout, "emt", "emt", cluster, {"passed": True, "device": "cpu", "fingerprint": FP}
    )

    def clone(data) -> None:
        checkpoints = data["envs"]["emt"]["checkpoints"]
        template = json.dumps(checkpoints["emt"])
        for i in range(12000):
            checkpoints[f"emt-copy-{i:05d}"] = json.loads(template)

    update_manifest(layout, clone)
    size = len(json.dumps(load_manifest(layout)))
    assert size > 4_500_000, size
    return layout


def push_big_manifest(dashboard: Dashboard, layout: InstallLayout, auth, monkeypatch, tmp_path):
    """``rootstock manifest push --json`` with the key in ``auth``: (exit, result, error, s)."""
    key, _, secret = auth["Authorization"].removeprefix("Bearer ").partition(":")
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("ROOTSTOCK_PUSH_RETRY_CAP", "20")
    save_config({"is_maintainer": True, "api_url": dashboard.url, "api_key": key,
                 "api_secret": secret})  # fmt: skip
    started = time.monotonic()
    out = CliRunner().invoke(cli, ["manifest", "push", "--json", "--root", str(layout.root)])
    seconds = time.monotonic() - started
    (result,) = json.loads(out.stdout)["results"]
    return out.exit_code, result, str(out.exception), seconds


@pytest.fixture(scope="module")
def big_cluster(sqlite_dashboard) -> str:
    """The big install's cluster, registered on the session's dashboard."""
    return sqlite_dashboard.add_cluster("bigcluster")


def test_manifest_push_of_a_large_manifest_says_check_the_key(
    sqlite_dashboard, big_install, big_cluster, monkeypatch, tmp_path
):
    code, result, error, seconds = push_big_manifest(
        sqlite_dashboard, big_install, bearer("rk_nosuchkey", "wrong"), monkeypatch, tmp_path
    )
    assert code == 1
    assert (result["status"], result["attempts"]) == (401, 1), result
    assert "refused the credentials" in error and "check api_key" in result["hint"]
    assert result["seconds"] < QUICK_S and seconds < CLI_WALL_S


def test_manifest_push_of_a_large_manifest_names_the_cluster_not_scoped(
    sqlite_dashboard, big_install, big_cluster, monkeypatch, tmp_path
):
    _other, auth = sqlite_dashboard.cluster_with_key()
    code, result, error, seconds = push_big_manifest(
        sqlite_dashboard, big_install, auth, monkeypatch, tmp_path
    )
    assert code == 1
    assert (result["status"], result["attempts"]) == (403, 1), result
    assert f"not scoped to cluster {big_cluster!r}" in error
    assert result["seconds"] < QUICK_S and seconds < CLI_WALL_S


def test_manifest_push_of_a_large_manifest_says_too_large(
    sqlite_dashboard, big_install, big_cluster, monkeypatch, tmp_path: Path
):
    auth = bearer(*sqlite_dashboard.issue_key(big_cluster))
    code, result, error, seconds = push_big_manifest(
        sqlite_dashboard, big_install, auth, monkeypatch, tmp_path
    )
    assert code == 1
    assert (result["status"], result["attempts"]) == (413, 1), result
    assert "larger than the dashboard accepts" in error
    assert result["seconds"] < QUICK_S and seconds < CLI_WALL_S
