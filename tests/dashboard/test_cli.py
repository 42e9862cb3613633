"""``rootstock dashboard ...`` as an operator runs it: real subprocesses, real databases."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import pytest

from tests.conftest import run_rootstock
from tests.dashboard.conftest import bearer, unique

pytestmark = pytest.mark.timeout(300)


def dashboard(*args: str, db: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_rootstock(
        "dashboard", *args, env={"ROOTSTOCK_DASHBOARD_DB": db}, timeout=120, check=check
    )


def test_credentials_workflow(dashboard_backend, new_database, start_dashboard):
    db = new_database(dashboard_backend)
    cluster = unique()
    added = dashboard("add-cluster", cluster, db=db)
    assert f"added cluster {cluster}" in added.stdout
    issued = json.loads(
        dashboard(
            "issue-key", "--cluster", cluster, "--maintainer", "ops@example.org", "--json", db=db
        ).stdout
    )
    assert issued["clusters"] == [cluster]
    assert issued["api_key"].startswith("rsk_")

    listed = json.loads(dashboard("keys", "--json", db=db).stdout)["keys"]
    assert [k["api_key"] for k in listed] == [issued["api_key"]]
    assert listed[0]["revoked_at"] is None
    assert issued["api_secret"] not in json.dumps(listed)

    server = start_dashboard(db)
    url = f"{server.url}api/v1/clusters/{cluster}/usage"
    auth = bearer(issued["api_key"], issued["api_secret"])
    assert httpx.post(url, json={"version": 1, "counts": []}, headers=auth).status_code == 200

    revoked = dashboard("revoke-key", issued["api_key"], db=db)
    assert issued["api_key"] in revoked.stdout
    assert json.loads(dashboard("keys", "--json", db=db).stdout)["keys"][0]["revoked_at"]
    assert httpx.post(url, json={"version": 1, "counts": []}, headers=auth).status_code == 401


def test_issue_key_prints_key_and_secret_once(tmp_path):
    db = str(tmp_path / "d.db")
    dashboard("add-cluster", "delta", db=db)
    out = dashboard("issue-key", "--cluster", "delta", "--maintainer", "ops@example.org", db=db)
    lines = dict(line.split(":", 1) for line in out.stdout.splitlines())
    assert lines["api_key"].strip().startswith("rsk_")
    assert len(lines["api_secret"].strip()) >= 43
    table = dashboard("keys", db=db).stdout
    assert "ops@example.org" in table
    assert lines["api_secret"].strip() not in table


@pytest.mark.parametrize(
    ("args", "message", "hint", "code"),
    [
        (
            ["issue-key", "--cluster", "nowhere", "--maintainer", "a@b.c"],
            "no cluster",
            "add-cluster nowhere",
            1,
        ),
        (["revoke-key", "rsk_nope"], "no key", "dashboard keys", 1),
        (["add-cluster", "Not Valid"], "not a valid cluster name", "lower-case", 2),
        (["add-cluster", "dup"], "already has a cluster", "issue-key", 1),
    ],
)
def test_operator_mistakes_are_clear_errors(tmp_path, args, message, hint, code):
    db = str(tmp_path / "d.db")
    dashboard("add-cluster", "dup", db=db)
    result = dashboard(*args, db=db, check=False)
    assert result.returncode == code
    assert message in result.stderr and hint in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("db", "message"),
    [
        ("mysql://u@localhost/x", "supports SQLite and PostgreSQL"),
        ("postgresql://nobody:pw@127.0.0.1:1/none", "cannot use the dashboard database"),
    ],
)
def test_bad_or_unreachable_database_is_a_clear_error(db, message):
    result = dashboard("keys", db=db, check=False)
    assert result.returncode == 1
    assert message in result.stderr
    assert "hint:" in result.stderr
    assert "pw@" not in result.stderr  # the password is never printed
    assert "Traceback" not in result.stderr


def test_serve_refuses_a_taken_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_rootstock(
            "dashboard",
            "serve",
            "--db",
            str(tmp_path / "d.db"),
            "--port",
            str(port),
            timeout=60,
            check=False,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "--port" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_extra_names_the_install_command(tmp_path):
    """Stand-in for an install without the extra: the interpreter is told fastapi is absent."""
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from rootstock.cli.main import main\n"
        "sys.exit(main(['dashboard', 'keys', '--db', sys.argv[1]]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "d.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "pip install 'rootstock[dashboard]'" in result.stderr
    assert "Traceback" not in result.stderr
