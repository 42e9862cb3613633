"""Usage records in a spool made by ``setup-perms``: the project group reads them, nobody
else does, whoever wrote them (runs as root, with real accounts and ACLs).

A maintainer applies ``setup-perms``; a member of the project group and an outsider
each write a record as their own account; a second outsider tries to read them.
Records used to be written 0644, so the second outsider could read everything and,
with the world-readable salt, tell whose records they were.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAINT, MEMBER, OUT1, OUT2 = "rsrec-maint", "rsrec-member", "rsrec-out1", "rsrec-out2"
PROJECT = "rsrec-proj"

_TOOLS = ("setfacl", "getfacl", "setpriv", "useradd", "groupadd", "usermod")
_missing = [tool for tool in _TOOLS if not shutil.which(tool)]
pytestmark = [
    pytest.mark.system,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="creates users and groups: needs root"),
    pytest.mark.skipif(bool(_missing), reason=f"needs {', '.join(_missing)}"),
]

# Writes one record as the calling account, with rootstock from this checkout.
WRITE = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from rootstock.install.usage import write_record
record = {"version": 1, "env": "emt", "checkpoint": "emt", "device": "cpu",
          "entry_point": "calculator", "start": "2026-11-05T10:00:00Z",
          "duration_s": 1.0, "force_calls": 2}
print(write_record(Path(sys.argv[2]), record))
"""

# The rootstock CLI as another account, from this checkout.
CLI = """
import sys
sys.path.insert(0, sys.argv.pop(1))
from rootstock.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=check)


def as_user(user: str, *argv: str | Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` as ``user``, with its groups and home, and no config override."""
    entry = pwd.getpwnam(user)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": entry.pw_dir, "USER": user}
    proc = subprocess.run(
        [
            *("setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups"),
            *("--", "/bin/sh", "-c", 'umask 022 && exec "$@"', "sh", *map(str, argv)),
        ],
        env=env,
        cwd="/",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"as {user}: {argv} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def accounts() -> Iterator[None]:
    _sh("groupadd", "-f", PROJECT)
    for user in (MAINT, MEMBER, OUT1, OUT2):
        try:
            pwd.getpwnam(user)
        except KeyError:
            _sh("useradd", "-m", "-s", "/bin/sh", user)
    for user in (MAINT, MEMBER):
        _sh("usermod", "-aG", PROJECT, user)
    yield
    for user in (MAINT, MEMBER, OUT1, OUT2):
        _sh("userdel", "-r", user, check=False)
    _sh("groupdel", PROJECT, check=False)


@pytest.fixture(scope="module")
def spool(accounts) -> Iterator[Path]:
    """An install root after ``setup-perms --apply``, run by the maintainer."""
    probe = as_user(OUT1, sys.executable, "-c", "import click, rich", check=False)
    if probe.returncode != 0:
        pytest.skip(f"{sys.executable} is not usable by other accounts here")
    Path("/srv").mkdir(mode=0o755, exist_ok=True)
    base = Path(f"/srv/rootstock-rec-{secrets.token_hex(4)}")
    base.mkdir(mode=0o755)
    shutil.chown(base, group=PROJECT)
    os.chmod(base, 0o2775)
    try:
        root = base / "install"
        args = ("setup-perms", root, "--group", PROJECT, "--apply", "--yes")
        as_user(MAINT, sys.executable, "-c", CLI, REPO / "src", *args)
        yield root / "usage"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def write_as(user: str, spool: Path) -> Path:
    out = as_user(user, sys.executable, "-c", WRITE, REPO / "src", spool).stdout
    return Path(out.strip().splitlines()[-1])


def test_only_the_project_group_reads_records_whoever_wrote_them(spool: Path):
    proj = spool.stat().st_gid
    member_record = write_as(MEMBER, spool)
    outsider_record = write_as(OUT1, spool)

    info = member_record.stat()
    assert stat.S_IMODE(info.st_mode) == 0o640 and info.st_gid == proj
    info = outsider_record.stat()
    assert stat.S_IMODE(info.st_mode) & 0o007 == 0  # nothing for others
    acl = _sh("getfacl", "-p", "--omit-header", str(outsider_record)).stdout
    assert "other::---" in acl and "group::---" in acl  # the outsider's own group: nothing
    assert f"group:{PROJECT}:" in acl and "#effective:r--" in acl

    for record in (member_record, outsider_record):
        assert as_user(OUT2, "cat", record, check=False).returncode != 0
        assert json.loads(as_user(MEMBER, "cat", record).stdout)["env"] == "emt"
    ids = set()
    for user, record in ((MEMBER, member_record), (OUT1, outsider_record)):
        id_file = Path(pwd.getpwnam(user).pw_dir) / ".config" / "rootstock" / "usage-id"
        assert stat.S_IMODE(id_file.stat().st_mode) == 0o600
        assert json.loads(record.read_text())["user"] == id_file.read_text().strip()
        ids.add(id_file.read_text().strip())
    assert len(ids) == 2
