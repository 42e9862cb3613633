"""The ``user`` of a usage record is a random id kept in the user's own config dir.

Before, it was a hash of the account name with a salt every user could read (each
had to compute its own hash), so anyone could hash the names in /etc/passwd and
re-identify every record. Now it is 128 random bits in a 0600 file in the account's
config dir, which nothing in the spool or the account name can produce; a process
that cannot keep that file uses a random id of its own. Records are 0640, in the
spool's group.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import stat
import threading
from pathlib import Path

import pytest

from rootstock.install.usage import SessionUsage
from rootstock.install.usage_id import USER_ID_NAME, read_or_create_user_id, usage_user_id
from rootstock.ops.usage import load_rollups
from tests.unit.usage_spool import drop, make_layout, record, run_usage

pytestmark = pytest.mark.timeout(60)
HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def layout(tmp_path, monkeypatch):
    return make_layout(tmp_path, monkeypatch)


def at_home(monkeypatch: pytest.MonkeyPatch, home: Path) -> Path:
    """Run as if ``home`` were $HOME with no config overrides; returns where the id goes."""
    monkeypatch.delenv("ROOTSTOCK_CONFIG", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    return home / ".config" / "rootstock" / USER_ID_NAME


def session_record(spool: Path) -> tuple[Path, dict]:
    usage = SessionUsage(spool, "emt", "emt", "cpu", "calculator")
    usage.connected = True
    path = usage.finish()
    assert path is not None
    return path, json.loads(path.read_text())


def test_the_user_is_the_random_id_in_the_users_own_0600_file(layout, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    id_file = at_home(monkeypatch, home)
    path, data = session_record(layout.usage_dir)
    assert data["user"] == id_file.read_text().strip()
    assert HEX32.fullmatch(data["user"])
    assert stat.S_IMODE(id_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(id_file.parent.stat().st_mode) == 0o700
    assert id_file.stat().st_uid == os.geteuid()
    # Nothing in the spool but the record: no salt to hash account names with.
    assert [p.name for p in layout.usage_dir.iterdir()] == [path.name]
    account = pwd.getpwuid(os.geteuid()).pw_name
    assert data["user"] not in {
        hashlib.sha256(account.encode()).hexdigest()[:32],
        hashlib.sha256(path.read_bytes() + b"\0" + account.encode()).hexdigest()[:32],
    }


def test_same_home_same_id_other_home_other_id(layout, tmp_path, monkeypatch):
    ids = {}
    for name in ("one", "two", "one"):
        (tmp_path / name).mkdir(exist_ok=True)
        at_home(monkeypatch, tmp_path / name)
        ids.setdefault(name, set()).add(session_record(layout.usage_dir)[1]["user"])
    assert len(ids["one"]) == 1 and len(ids["two"]) == 1
    # The same account, the same spool: the id is not derived from either.
    assert ids["one"] != ids["two"]


def test_xdg_config_home_and_rootstock_config_place_the_id(layout, tmp_path, monkeypatch):
    at_home(monkeypatch, tmp_path / "home")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    user = session_record(layout.usage_dir)[1]["user"]
    assert (tmp_path / "xdg" / "rootstock" / USER_ID_NAME).read_text().strip() == user
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "elsewhere" / "config.toml"))
    other = session_record(layout.usage_dir)[1]["user"]
    assert (tmp_path / "elsewhere" / USER_ID_NAME).read_text().strip() == other != user


def test_no_config_dir_still_records_with_a_random_id_for_the_process(
    layout, tmp_path, monkeypatch
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    at_home(monkeypatch, tmp_path / "home")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker / "config"))  # cannot be a directory
    first = session_record(layout.usage_dir)[1]["user"]
    second = session_record(layout.usage_dir)[1]["user"]
    assert HEX32.fullmatch(first) and first == second == usage_user_id()
    assert not (tmp_path / "home").exists()
    (tmp_path / "home").mkdir()
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert session_record(layout.usage_dir)[1]["user"] != first


@pytest.mark.parametrize("content", ["", "not-an-id\n", "ABCDEF" * 6, "0" * 31])
def test_a_damaged_id_file_is_left_alone_and_a_process_id_used(tmp_path, monkeypatch, content):
    id_file = at_home(monkeypatch, tmp_path)
    id_file.parent.mkdir(parents=True)
    id_file.write_text(content)
    assert HEX32.fullmatch(usage_user_id())
    assert id_file.read_text() == content


def test_an_id_file_readable_by_others_is_made_private(tmp_path, monkeypatch):
    id_file = at_home(monkeypatch, tmp_path)
    id_file.parent.mkdir(parents=True)
    id_file.write_text("0123456789abcdef" * 2 + "\n")
    os.chmod(id_file, 0o644)
    assert usage_user_id() == "0123456789abcdef" * 2
    assert stat.S_IMODE(id_file.stat().st_mode) == 0o600


def test_a_symlinked_id_file_is_not_followed(tmp_path, monkeypatch):
    id_file = at_home(monkeypatch, tmp_path / "home")
    id_file.parent.mkdir(parents=True)
    theirs = tmp_path / "theirs"
    theirs.write_text("0123456789abcdef" * 2 + "\n")
    id_file.symlink_to(theirs)
    assert usage_user_id() != "0123456789abcdef" * 2


def test_concurrent_first_sessions_agree_on_one_id(tmp_path):
    path = tmp_path / "cfg" / USER_ID_NAME
    seen: list[str] = []
    threads = [
        threading.Thread(target=lambda: seen.append(read_or_create_user_id(path)))
        for _ in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(seen) == 16 and len(set(seen)) == 1
    assert [p.name for p in path.parent.iterdir()] == [USER_ID_NAME]  # no temp left


def test_records_are_0640_in_the_spools_group(layout):
    spool = layout.usage_dir
    if os.geteuid() == 0:
        os.chown(spool, -1, 4242)  # root may hand a file to any group
    path, _ = session_record(spool)
    info = path.stat()
    assert stat.S_IMODE(info.st_mode) == 0o640
    assert info.st_gid == spool.stat().st_gid


def test_old_salted_records_are_kept_and_compact_deletes_the_old_salt(layout, capsys):
    spool = layout.usage_dir
    salt = b"ab" * 32
    (spool / ".salt").write_bytes(salt + b"\n")
    old_hash = hashlib.sha256(salt + b"\0" + b"alice").hexdigest()[:32]
    drop(spool, "20261101T000000Z-old.json", record(user=old_hash))
    code, out = run_usage(capsys, layout, "compact")
    assert code == 0, out
    assert "folded 1 record(s)" in out and "removed the old salt" in out
    assert not (spool / ".salt").exists()
    (group,) = load_rollups(spool)["2026-11"].groups.values()
    assert group.users == {old_hash}  # an old record counts as it was written
    code, out = run_usage(capsys, layout, "compact")
    assert code == 0 and "salt" not in out
