"""Spool entries that are not regular files: counted as unreadable, never followed, never
waited on.

Anyone can create anything in the 1777 spool: a FIFO (which would block a plain
``open`` for reading until a writer came), a symlink (to another user's file, or to
nowhere), a directory. Each named like a record is an unreadable record: counted in
``unreadable_records``, never folded. The same rule holds in ``rollups/``, which
someone other than a maintainer may have created before the first compact.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from rootstock.install.usage import read_records
from rootstock.ops.usage import Rollup, UsageRollupError, compact, usage_report
from tests.unit.usage_spool import DAY, drop, make_layout, record, rollup_file, run_usage

# A FIFO opened without O_NONBLOCK blocks forever: the timeout is what fails then.
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def layout(tmp_path, monkeypatch):
    return make_layout(tmp_path, monkeypatch)


def strange_entries(spool, elsewhere):
    """A FIFO, three symlinks and a directory, each named like a record."""
    good = drop(elsewhere, "good.json", record(user="linked"))
    os.mkfifo(spool / "20261105T000000Z-fifo.json")
    (spool / "20261105T000000Z-link.json").symlink_to(good)
    (spool / "20261105T000000Z-passwd.json").symlink_to("/etc/passwd")
    (spool / "20261105T000000Z-dangling.json").symlink_to(elsewhere / "nothing.json")
    (spool / "20261105T000000Z-dir.json").mkdir()
    return [
        "20261105T000000Z-dangling.json",
        "20261105T000000Z-dir.json",
        "20261105T000000Z-fifo.json",
        "20261105T000000Z-link.json",
        "20261105T000000Z-passwd.json",
    ]


def test_fifo_symlink_and_directory_are_unreadable_records(layout, tmp_path, capsys):
    spool = layout.usage_dir
    (tmp_path / "elsewhere").mkdir()
    names = strange_entries(spool, tmp_path / "elsewhere")
    drop(spool, "20261105T000000Z-real.json", record())
    records, unreadable = read_records(spool)
    assert list(records) == ["20261105T000000Z-real.json"]
    assert unreadable == names
    report = usage_report(layout)
    assert report["unreadable_records"] == 5
    assert report["totals"] == {"users": 1, "sessions": 1, "force_calls": 3}
    code, out = run_usage(capsys, layout, "report")
    assert code == 0 and "5 record(s) could not be read" in out


def test_compact_expires_old_fifos_and_links_and_keeps_directories(layout, tmp_path, capsys):
    spool = layout.usage_dir
    (tmp_path / "elsewhere").mkdir()
    names = strange_entries(spool, tmp_path / "elsewhere")
    old = time.time() - 8 * DAY
    for name in names:
        os.utime(spool / name, (old, old), follow_symlinks=False)
    code, out = run_usage(capsys, layout, "compact")
    assert code == 0, out
    assert "folded 0 record(s)" in out
    assert "removed 4 unreadable record(s)" in out and "1 unreadable record(s) skipped" in out
    assert sorted(p.name for p in spool.iterdir()) == ["20261105T000000Z-dir.json", "rollups"]
    assert (tmp_path / "elsewhere" / "good.json").exists()  # a link's target is never touched
    assert os.path.exists("/etc/passwd")


def test_young_fifos_and_links_are_kept_and_counted(layout, tmp_path):
    spool = layout.usage_dir
    (tmp_path / "elsewhere").mkdir()
    names = strange_entries(spool, tmp_path / "elsewhere")
    result = compact(layout)
    assert (result.folded, result.torn_removed, result.torn_kept) == (0, 0, len(names))
    assert all((spool / name).is_symlink() or (spool / name).exists() for name in names)


def rollups_dir(layout):
    path = layout.usage_dir / "rollups"
    path.mkdir()
    return path


def test_a_fifo_in_rollups_never_hangs_report_or_compact(layout):
    os.mkfifo(rollups_dir(layout) / "2026-11.json")
    for action in (usage_report, compact):
        with pytest.raises(UsageRollupError, match="not a regular file"):
            action(layout)


def test_a_symlinked_rollup_is_refused(layout, tmp_path):
    real = tmp_path / "2026-11.json"
    rollup = Rollup("2026-11")
    rollup.fold("a.json", record())
    rollup.pending.clear()
    real.write_text(json.dumps(rollup.to_json()))
    rollup_file(layout).parent.mkdir()
    rollup_file(layout).symlink_to(real)
    with pytest.raises(UsageRollupError, match="not a regular file"):
        usage_report(layout)


@pytest.mark.skipif(os.geteuid() != 0, reason="hands rollups/ to another uid: needs root")
def test_a_rollups_dir_made_by_a_stranger_is_refused(layout):
    stranger = rollups_dir(layout)
    bogus = {"version": 2, "month": "2026-11", "groups": [], "folded_count": 0}
    (stranger / "2026-11.json").write_text(json.dumps(bogus))  # would block every push
    os.chown(stranger, 54321, 54321)
    drop(layout.usage_dir, "a.json", record())
    for action in (usage_report, compact):
        with pytest.raises(UsageRollupError, match="owned by uid 54321") as info:
            action(layout)
        assert "remove" in (info.value.hint or "")
    assert (layout.usage_dir / "a.json").exists()


def test_rollups_as_a_symlink_is_refused(layout, tmp_path):
    (tmp_path / "mine").mkdir()
    (layout.usage_dir / "rollups").symlink_to(tmp_path / "mine")
    drop(layout.usage_dir, "a.json", record())
    for action in (usage_report, compact):
        with pytest.raises(UsageRollupError, match="not a directory"):
            action(layout)
    assert list((tmp_path / "mine").iterdir()) == []
