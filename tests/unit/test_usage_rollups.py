"""Rollups that keep a count and a digest, and rollup files that are not rollups.

Everything runs on real files in a temp spool (no workers, no subprocesses). Where
a crash or a refused delete is needed, the test says so and stages it through
the one seam compact deletes with, or by writing the files a crash leaves.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rootstock.ops.usage as ops_usage
from rootstock.errors import RootstockError
from rootstock.install.usage import read_records
from rootstock.ops.usage import (
    ROLLUP_VERSION,
    Rollup,
    UsageRollupError,
    compact,
    load_rollups,
    name_digest,
    usage_report,
)
from tests.unit.usage_spool import (
    DAY,
    drop,
    json_values,
    make_layout,
    numbers,
    record,
    rollup_file,
    run_usage,
    spool_bytes,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def layout(tmp_path, monkeypatch):
    return make_layout(tmp_path, monkeypatch)


class SimulatedKill(BaseException):
    """Stands in for SIGKILL at a chosen step: nothing after it in compact runs."""


# --- item 1: a count and a digest, not a list of names --------------------------------


def test_5000_records_fold_into_a_small_rollup_with_the_same_report(layout):
    spool = layout.usage_dir
    names = []
    for i in range(5000):
        name = f"20261105T000000Z-{i:016x}.json"
        drop(spool, name, record(env=("emt", "mace")[i % 2], user=f"user{i % 7}", calls=i % 5))
        names.append(name)
    before = usage_report(layout)
    result = compact(layout)
    assert (result.folded, result.deleted, result.months) == (5000, 5000, ["2026-11"])
    assert rollup_file(layout).stat().st_size < 3000  # the names alone would be ~190 KB
    data = json.loads(rollup_file(layout).read_text())
    assert data["version"] == ROLLUP_VERSION == 2
    assert data["folded_count"] == 5000 and data["pending"] == []
    assert int(data["folded_digest"], 16) == name_digest(names)
    assert "folded" not in data
    after = usage_report(layout)
    assert numbers(after) == numbers(before)
    assert after["totals"] == {"users": 7, "sessions": 5000, "force_calls": 2 * 5000}
    assert read_records(spool) == ({}, [])


def test_digest_is_order_independent_and_sees_a_double_fold():
    names = [f"r{i}.json" for i in range(20)]
    assert name_digest(names) == name_digest(reversed(names))
    assert name_digest(names + names[:1]) != name_digest(names)  # a sum, not XOR


# --- item 4: crashes between the rollup write and the deletions ----------------------


def _kill_on_delete(monkeypatch, after: int) -> None:
    """Fake a SIGKILL once ``after`` records have been deleted."""
    deleted = []
    real = ops_usage._delete_record

    def delete(path: Path) -> None:
        if len(deleted) == after:
            raise SimulatedKill
        real(path)
        deleted.append(path)

    monkeypatch.setattr(ops_usage, "_delete_record", delete)


def _kill_on_second_rollup_write(monkeypatch) -> None:
    """Fake a SIGKILL after every deletion, as compact rewrites the settled rollup."""
    writes = []
    real = ops_usage.atomic_write_json

    def write(path, obj, mode=None):
        writes.append(path)
        if len(writes) == 2:
            raise SimulatedKill
        real(path, obj, mode=mode)

    monkeypatch.setattr(ops_usage, "atomic_write_json", write)


@pytest.mark.parametrize("kill", ["before-any-delete", "mid-deletion", "before-rewrite"])
def test_crash_between_rollup_write_and_deletion_never_double_counts(layout, monkeypatch, kill):
    spool = layout.usage_dir
    names = [f"2026110{i}T000000Z-{i:016x}.json" for i in range(5)]
    for i, name in enumerate(names):
        drop(spool, name, record(user=f"u{i % 2}", calls=i))
    expected = numbers(usage_report(layout))
    if kill == "before-rewrite":
        _kill_on_second_rollup_write(monkeypatch)
    else:
        _kill_on_delete(monkeypatch, after=0 if kill == "before-any-delete" else 2)
    with pytest.raises(SimulatedKill):
        compact(layout)
    monkeypatch.undo()

    # The rollup on disk counts all five and names them as pending.
    data = json.loads(rollup_file(layout).read_text())
    assert data["folded_count"] == 5 and data["pending"] == sorted(names)
    left = {"before-any-delete": 5, "mid-deletion": 3, "before-rewrite": 0}[kill]
    assert len(read_records(spool)[0]) == left
    assert numbers(usage_report(layout)) == expected
    assert usage_report(layout)["unfolded_records"] == 0

    result = compact(layout)
    assert (result.folded, result.deleted) == (0, left)
    data = json.loads(rollup_file(layout).read_text())
    assert data["pending"] == [] and data["folded_count"] == 5
    assert int(data["folded_digest"], 16) == name_digest(names)  # each name once
    assert numbers(usage_report(layout)) == expected
    assert not any(spool.glob("*.json"))


def test_an_undeletable_record_stays_pending_until_its_owner_compacts(layout, monkeypatch):
    spool = layout.usage_dir
    drop(spool, "a.json", record(user="x"))
    drop(spool, "b.json", record(user="y"))
    expected = numbers(usage_report(layout))
    real = ops_usage._delete_record

    def sticky(path: Path) -> None:  # fake: the sticky bit refusing a non-owner
        if path.name == "b.json":
            raise PermissionError(1, "Operation not permitted", str(path))
        real(path)

    monkeypatch.setattr(ops_usage, "_delete_record", sticky)
    for _ in range(2):
        result = compact(layout)
        assert result.undeletable == ["b.json"]
        assert json.loads(rollup_file(layout).read_text())["pending"] == ["b.json"]
        assert numbers(usage_report(layout)) == expected
    monkeypatch.undo()
    result = compact(layout)  # the owner's compact
    assert (result.folded, result.deleted, result.undeletable) == (0, 1, [])
    assert json.loads(rollup_file(layout).read_text())["pending"] == []
    assert numbers(usage_report(layout)) == expected


# --- migration from schema 1 -----------------------------------------------------------


def test_schema_1_rollup_is_read_then_rewritten_as_schema_2(layout, capsys):
    spool = layout.usage_dir
    # What a schema-1 compact killed before its deletions left: a.json and b.json
    # still on disk and named, c.json folded and gone.
    drop(spool, "a.json", record(user="x", calls=1))
    drop(spool, "b.json", record(user="y", calls=2))
    (spool / "rollups").mkdir()
    old = {
        "version": 1,
        "month": "2026-11",
        "groups": [
            {
                "env": "emt",
                "checkpoint": "emt",
                "sessions": 3,
                "force_calls": 7,
                "users": ["x", "y"],
            }
        ],
        "folded": ["a.json", "b.json", "c.json"],
    }
    rollup_file(layout).write_text(json.dumps(old))
    expected = {"users": 2, "sessions": 3, "force_calls": 7}
    assert usage_report(layout)["totals"] == expected
    drop(spool, "d.json", record(user="z", calls=5))  # a new record, folded by this compact

    code, out = run_usage(capsys, layout, "compact")
    assert code == 0, out
    data = json.loads(rollup_file(layout).read_text())
    assert data["version"] == 2 and "folded" not in data
    assert data["folded_count"] == 4 and data["pending"] == []
    assert int(data["folded_digest"], 16) == name_digest(["a.json", "b.json", "c.json", "d.json"])
    assert usage_report(layout)["totals"] == {"users": 3, "sessions": 4, "force_calls": 12}
    assert read_records(spool) == ({}, [])


def test_schema_1_rollup_is_migrated_even_when_nothing_is_left_to_fold(layout):
    (layout.usage_dir / "rollups").mkdir()
    old = {
        "version": 1,
        "month": "2026-10",
        "groups": [
            {"env": "emt", "checkpoint": "emt", "sessions": 1, "force_calls": 2, "users": ["x"]}
        ],
        "folded": ["gone.json"],
    }
    rollup_file(layout, "2026-10").write_text(json.dumps(old))
    compact(layout)
    data = json.loads(rollup_file(layout, "2026-10").read_text())
    assert (data["version"], data["folded_count"], data["pending"]) == (2, 1, [])


# --- item 3: a corrupt rollup is a clean error, and nothing is written ----------------------


def _good_rollup() -> dict:
    """A valid schema-2 rollup of one folded record, written out by hand."""
    return {
        "version": 2,
        "month": "2026-11",
        "groups": [
            {"env": "emt", "checkpoint": "emt", "sessions": 1, "force_calls": 3, "users": ["u1"]}
        ],
        "folded_count": 1,
        "folded_digest": f"{name_digest(['a.json']):064x}",
        "pending": [],
    }


def test_the_hand_written_rollup_is_what_compact_writes(layout):
    drop(layout.usage_dir, "a.json", record())
    compact(layout)
    assert json.loads(rollup_file(layout).read_text()) == _good_rollup()


def _with(**changes) -> bytes:
    return json.dumps(dict(_good_rollup(), **changes)).encode()


def _with_group(**changes) -> bytes:
    data = _good_rollup()
    data["groups"][0].update(changes)
    return json.dumps(data).encode()


CORRUPT_ROLLUPS = {
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "deep-in-groups": _with(groups=[]).replace(
        b'"groups": []', b'"groups": ' + b"[" * 90 + b"]" * 90
    ),
    "nan": _with_group().replace(b'"force_calls": 3', b'"force_calls": NaN'),
    "huge-number": _with_group().replace(b'"force_calls": 3', b'"force_calls": 1e999'),
    "not-utf8": b"\xff" + _with(),
    "empty": b"",
    "not-an-object": b"[1, 2]",
    "groups-not-a-list": _with(groups={"env": "emt"}),
    "group-not-an-object": _with(groups=["emt"]),
    "sessions-a-string": _with_group(sessions="1"),
    "force-calls-a-string": _with_group(force_calls="3"),
    "sessions-a-float": _with_group(sessions=1.5),
    "sessions-a-bool": _with_group(sessions=True),
    "sessions-negative": _with_group(sessions=-1),
    "users-not-a-list": _with_group(users="u1"),
    "user-not-a-string": _with_group(users=[5]),
    "env-missing": json.dumps(
        dict(
            _good_rollup(),
            groups=[{"checkpoint": "emt", "sessions": 1, "force_calls": 3, "users": []}],
        )
    ).encode(),
    "duplicate-group": _with(groups=_good_rollup()["groups"] * 2, folded_count=2),
    "count-disagrees": _with(folded_count=9),
    "digest-not-hex": _with(folded_digest="zz"),
    "pending-not-a-list": _with(pending="a.json"),
    "pending-a-path": _with(pending=["../../etc/x.json"]),
    "version-missing": json.dumps(
        {k: v for k, v in _good_rollup().items() if k != "version"}
    ).encode(),
    "version-a-string": _with(version="2"),
    "month-of-another-file": _with(month="2026-10"),
    "schema-1-folded-not-a-list": _with(version=1, folded=7),
}


@pytest.mark.parametrize("variant", sorted(CORRUPT_ROLLUPS))
@pytest.mark.parametrize("command", ["report", "compact"])
def test_a_corrupt_rollup_is_a_clean_error_and_nothing_is_written(layout, capsys, variant, command):
    spool = layout.usage_dir
    drop(spool, "b.json", record(user="y"))
    old = drop(spool, "old-torn.json", "{")
    os.utime(old, (time.time() - 30 * DAY,) * 2)  # compact would remove it, were it to run on
    (spool / "rollups").mkdir()
    rollup_file(layout).write_bytes(CORRUPT_ROLLUPS[variant])
    before = spool_bytes(spool)

    code, out = run_usage(capsys, layout, command)
    assert code == 1, out
    assert out.startswith(f"error: usage rollup {rollup_file(layout)}"), out
    assert "hint:" in out and "Traceback" not in out
    assert spool_bytes(spool) == before


def test_a_newer_rollup_schema_is_refused(layout, capsys):
    (layout.usage_dir / "rollups").mkdir()
    rollup_file(layout).write_bytes(_with(version=ROLLUP_VERSION + 1))
    code, out = run_usage(capsys, layout, "report")
    assert code == 1 and "newer rootstock" in out and "upgrade rootstock" in out


# --- fuzz: any rollup content is a rollup or a clean refusal ---------------------

rollup_like = st.fixed_dictionaries(
    {},
    optional={
        "version": st.sampled_from([1, 2, 3, "2", None]),
        "month": st.sampled_from(["2026-11", "2026-13", 5]),
        "groups": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "env": json_values,
                    "checkpoint": json_values,
                    "sessions": json_values,
                    "force_calls": json_values,
                    "users": json_values,
                },
            ),
            max_size=3,
        )
        | json_values,
        "folded": json_values,
        "folded_count": json_values,
        "folded_digest": st.just("0" * 64) | json_values,
        "pending": json_values,
    },
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(rollup_like, json_values))
def test_fuzz_rollup_content_parses_or_is_refused_cleanly(data):
    try:
        rollup = Rollup.from_json(data)
    except UsageRollupError as exc:
        assert exc.hint
        return
    assert Rollup.from_json(json.loads(json.dumps(rollup.to_json()))).to_json() == rollup.to_json()


folds = st.lists(
    st.tuples(
        st.from_regex(r"[0-9a-z]{1,12}\.json", fullmatch=True),
        st.sampled_from(["emt", "mace"]),
        st.sampled_from(["u1", "u2", "u3"]),
        st.none() | st.integers(0, 10**6),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(folds, st.integers(0, 30))
def test_fuzz_any_folding_round_trips_and_digests_each_name_once(folds, settle):
    rollup = Rollup("2026-11")
    folded = [
        name
        for name, env, user, calls in folds
        if rollup.fold(name, record(env=env, user=user, calls=calls))
    ]
    assert len(folded) == len(set(folded)) == rollup.folded_count
    rollup.pending = set(sorted(rollup.pending)[:settle])  # some deleted, some not yet
    again = Rollup.from_json(json.loads(json.dumps(rollup.to_json())))
    assert again.to_json() == rollup.to_json()
    assert again.folded_digest == name_digest(folded)
    assert sum(t.sessions for t in again.groups.values()) == len(folded)


def test_load_rollups_ignores_files_that_are_not_months(layout):
    (layout.usage_dir / "rollups").mkdir()
    (layout.usage_dir / "rollups" / "notes.json").write_text("[[[")
    (layout.usage_dir / "rollups" / ".2026-11.json.tmp-1-ab").write_text("[[[")
    assert load_rollups(layout.usage_dir) == {}


def test_a_rollup_error_names_the_field_and_is_a_rootstock_error():
    wrong = r"groups: should be a list, is a whole number"
    with pytest.raises(RootstockError, match=wrong) as info:
        Rollup.from_json({"version": 2, "month": "2026-11", "groups": 5}, where="usage rollup X")
    assert isinstance(info.value, UsageRollupError)
    assert str(info.value).startswith("usage rollup X is invalid: groups:")
