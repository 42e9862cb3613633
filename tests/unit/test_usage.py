"""Usage records, rollups and aggregation, on a spool in a temp dir (no workers)."""

from __future__ import annotations

import json
import os
import pwd
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from rootstock.cli.main import cli
from rootstock.errors import PushNotConfigured
from rootstock.install.layout import InstallLayout
from rootstock.install.usage import (
    DISABLE_ENV,
    LOCAL_CHECKPOINT,
    SessionUsage,
    current_entry_point,
    entry_point,
    read_records,
    write_record,
)
from rootstock.install.usage_id import user_id_path
from rootstock.ops.push import push_usage
from rootstock.ops.usage import (
    Rollup,
    Tally,
    UsageSpoolMissing,
    compact,
    tally_records,
    usage_report,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    layout = InstallLayout(root=tmp_path / "root", cache_root=tmp_path / "root")
    layout.usage_dir.mkdir(parents=True)
    os.chmod(layout.usage_dir, 0o1777)
    return layout


def record(
    month: str = "2026-11",
    env: str = "emt",
    ckpt: str = "emt",
    user: str = "u1",
    calls: int | None = 3,
) -> dict:
    return {
        "version": 1,
        "env": env,
        "checkpoint": ckpt,
        "device": "cpu",
        "entry_point": "calculator",
        "start": f"{month}-05T10:00:00Z",
        "duration_s": 1.5,
        "force_calls": calls,
        "user": user,
    }


def drop(spool: Path, name: str, rec: dict) -> None:
    (spool / name).write_text(json.dumps(rec))


def session(spool: Path, checkpoint: str = "emt", calls: int = 2) -> SessionUsage:
    usage = SessionUsage(spool, "emt", checkpoint, "cpu", "calculator")
    usage.connected = True
    usage.force_calls = calls
    return usage


# --- records ------------------------------------------------------------------------------


def test_record_fields_mode_and_no_username(layout, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    path = session(layout.usage_dir, calls=4).finish()
    assert path is not None and path.parent == layout.usage_dir
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    data = json.loads(path.read_text())
    assert set(data) == {
        "version",
        "env",
        "checkpoint",
        "device",
        "entry_point",
        "start",
        "duration_s",
        "force_calls",
        "user",
    }
    assert data["force_calls"] == 4 and data["entry_point"] == "calculator"
    assert data["start"].endswith("Z")
    assert data["user"] == user_id_path().read_text().strip()  # tests/unit/test_usage_identity.py
    assert pwd.getpwuid(os.geteuid()).pw_name not in path.read_text()
    assert [p.name for p in layout.usage_dir.iterdir()] == [path.name]  # no salt, nothing else


def test_custom_weights_are_recorded_as_local(layout):
    path = session(layout.usage_dir, checkpoint="mace:custom").finish()
    assert json.loads(path.read_text())["checkpoint"] == LOCAL_CHECKPOINT


def test_finish_records_once_and_only_after_connecting(layout):
    usage = SessionUsage(layout.usage_dir, "emt", "emt", "cpu", "calculator")
    assert usage.finish() is None  # never connected
    usage = session(layout.usage_dir)
    assert usage.finish() is not None
    assert usage.finish() is None
    assert len(read_records(layout.usage_dir)[0]) == 1


def test_opt_out_missing_and_read_only_spool_record_nothing_and_never_raise(
    layout, tmp_path, monkeypatch
):
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert session(layout.usage_dir).finish() is None
    monkeypatch.delenv(DISABLE_ENV)
    assert session(tmp_path / "nowhere").finish() is None
    assert not (tmp_path / "nowhere").exists()  # a missing spool is never created
    (tmp_path / "a-file").write_text("")  # a broken spool (read-only: tests/integration)
    assert session(tmp_path / "a-file").finish() is None
    assert read_records(layout.usage_dir) == ({}, [])


def test_unique_names_under_many_writes(layout):
    names = {write_record(layout.usage_dir, record()).name for _ in range(200)}
    assert len(names) == 200


def test_entry_point_context():
    assert current_entry_point() == "calculator"
    with entry_point("verify"):
        assert current_entry_point() == "verify"
    assert current_entry_point() == "calculator"


def test_unparseable_record_is_skipped_not_counted(layout):
    (layout.usage_dir / "20261105T000000Z-half.json").write_text('{"env": ')
    drop(layout.usage_dir, "a.json", record())
    records, unreadable = read_records(layout.usage_dir)
    assert list(records) == ["a.json"] and unreadable == ["20261105T000000Z-half.json"]


# --- aggregation and rollups ----------------------------------------------------------


def test_tally_groups_and_counts_distinct_users():
    tallies = tally_records(
        [
            record(user="a"),
            record(user="a"),
            record(user="b", calls=None),
            record(month="2026-12", user="a"),
            record(ckpt=LOCAL_CHECKPOINT, user="c"),
        ]
    )
    nov = tallies[("2026-11", "emt", "emt")]
    assert (nov.sessions, nov.force_calls, nov.users) == (3, 6, {"a", "b"})
    assert tallies[("2026-12", "emt", "emt")].sessions == 1
    assert tallies[("2026-11", "emt", LOCAL_CHECKPOINT)].users == {"c"}


def test_rollup_fold_skips_folded_names_and_roundtrips():
    rollup = Rollup("2026-11")
    assert rollup.fold("a.json", record(user="x"))
    assert not rollup.fold("a.json", record(user="x"))
    assert rollup.fold("b.json", record(user="y", calls=1))
    again = Rollup.from_json(json.loads(json.dumps(rollup.to_json())))
    assert again.pending == {"a.json", "b.json"} and again.folded_count == 2
    tally = again.groups[("emt", "emt")]
    assert (tally.sessions, tally.force_calls, tally.users) == (2, 4, {"x", "y"})


def test_distinct_users_survive_several_compactions(layout):
    spool = layout.usage_dir
    drop(spool, "a.json", record(user="x"))
    drop(spool, "b.json", record(user="y"))
    compact(layout)
    drop(spool, "c.json", record(user="x"))  # the same user again, next compaction
    drop(spool, "d.json", record(month="2026-12", user="z"))
    before = usage_report(layout)
    result = compact(layout)
    after = usage_report(layout)
    assert result.folded == 2 and result.deleted == 2
    assert before["rows"] == after["rows"]
    assert after["totals"] == {"users": 3, "sessions": 4, "force_calls": 12}
    nov = next(r for r in after["rows"] if r["month"] == "2026-11")
    assert nov["users"] == 2 and nov["sessions"] == 3
    assert read_records(spool) == ({}, [])


def test_crash_between_rollup_and_delete_never_double_counts(layout):
    spool = layout.usage_dir
    for i in range(5):
        drop(spool, f"r{i}.json", record(user=f"u{i % 2}"))
    expected = usage_report(layout)["totals"]
    # A compact killed after its rollup was durable, before any record was deleted:
    rollup = Rollup("2026-11")
    for i in range(5):
        rollup.fold(f"r{i}.json", record(user=f"u{i % 2}"))
    (spool / "rollups").mkdir()
    (spool / "rollups" / "2026-11.json").write_text(json.dumps(rollup.to_json()))
    assert usage_report(layout)["totals"] == expected
    result = compact(layout)
    assert result.folded == 0 and result.deleted == 5
    assert usage_report(layout)["totals"] == expected


def test_report_since_and_json_shape(layout):
    drop(layout.usage_dir, "a.json", record(month="2026-10"))
    drop(layout.usage_dir, "b.json", record(month="2026-11", env="mace", ckpt="m"))
    report = usage_report(layout, since="2026-11")
    assert set(report) == {
        "version",
        "spool",
        "since",
        "rows",
        "totals",
        "unfolded_records",
        "unreadable_records",
        "rollup_entries_out_of_bounds",
    }
    assert [r["month"] for r in report["rows"]] == ["2026-11"]
    assert set(report["rows"][0]) == {
        "month",
        "env",
        "checkpoint",
        "users",
        "sessions",
        "force_calls",
    }
    assert report["totals"]["sessions"] == 1


def test_missing_spool_and_push_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "config.toml"))
    layout = InstallLayout(root=tmp_path, cache_root=tmp_path)
    with pytest.raises(UsageSpoolMissing, match="no usage spool"):
        usage_report(layout)
    with pytest.raises(PushNotConfigured, match="no dashboard to push to") as info:
        push_usage(layout)
    assert "api_url" in str(info.value) and "api_key" in str(info.value)
    assert "rootstock init" in str(info.value)


def test_tally_merge():
    a = Tally(1, 2, {"x"})
    a.merge(Tally(2, 3, {"x", "y"}))
    assert (a.sessions, a.force_calls, a.users) == (3, 5, {"x", "y"})


def test_cli_report_json_compact_and_push(layout, tmp_path, monkeypatch):
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "config.toml"))
    drop(layout.usage_dir, "a.json", record(user="x"))
    runner = CliRunner()
    root = ["--root", str(layout.root), "--cache-root", str(layout.cache_root)]
    out = runner.invoke(cli, ["usage", "report", "--json", *root])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["totals"]["users"] == 1
    bad = runner.invoke(cli, ["usage", "report", "--since", "2026-13", *root])
    assert bad.exit_code != 0
    assert runner.invoke(cli, ["usage", "compact", *root]).exit_code == 0
    pushed = runner.invoke(cli, ["usage", "push", *root])
    assert isinstance(pushed.exception, PushNotConfigured)
