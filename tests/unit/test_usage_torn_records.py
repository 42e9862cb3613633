"""Records nobody can use: skipped, never counted, deleted by compact after 7 days.

Real files in a temp spool; ages are set with ``os.utime``.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rootstock.install.parsing import ParseProblem
from rootstock.install.usage import (
    RECORD_MAX_BYTES,
    TORN_RECORD_MAX_AGE_S,
    expire_torn_records,
    parse_record,
    read_records,
    record_month,
)
from rootstock.ops.usage import compact, tally_records, usage_report
from tests.unit.usage_spool import DAY, drop, json_values, make_layout, record, run_usage

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def layout(tmp_path, monkeypatch):
    return make_layout(tmp_path, monkeypatch)


def test_torn_records_are_deleted_after_7_days_and_kept_before(layout, capsys):
    spool = layout.usage_dir
    now = time.time()
    old_torn = drop(spool, "20261101T000000Z-old.json", '{"env": ')
    old_partial = drop(spool, "20261101T000000Z-nouser.json", {"start": "2026-11-01T00:00:00Z"})
    young_torn = drop(spool, "20261130T000000Z-young.json", '{"env": "em')
    almost = drop(spool, "20261124T000000Z-almost.json", "")
    for path, age in ((old_torn, 8 * DAY), (old_partial, 30 * DAY), (almost, 7 * DAY - 600)):
        os.utime(path, (now - age, now - age))
    good = drop(spool, "20261101T000000Z-good.json", record())
    os.utime(good, (now - 30 * DAY, now - 30 * DAY))  # old but readable: folded, not expired

    report = usage_report(layout)
    assert report["unreadable_records"] == 4 and report["totals"]["sessions"] == 1
    code, out = run_usage(capsys, layout, "compact")
    assert code == 0, out
    assert "removed 2 unreadable record(s) older than 7 days" in out
    assert "2 unreadable record(s) skipped and kept" in out
    assert not old_torn.exists() and not old_partial.exists() and not good.exists()
    assert young_torn.exists() and almost.exists()
    assert usage_report(layout)["totals"]["sessions"] == 1


def test_compact_result_counts_torn_records(layout):
    spool = layout.usage_dir
    old = drop(spool, "x.json", "[1, 2")
    os.utime(old, (time.time() - 8 * DAY,) * 2)
    drop(spool, "y.json", "not json")
    result = compact(layout)
    assert (result.torn_removed, result.torn_kept) == (1, 1)


def test_expire_leaves_a_torn_record_it_cannot_delete(tmp_path):
    # A directory named like a record is not a record file: never removed.
    (tmp_path / "d.json").mkdir()
    os.utime(tmp_path / "d.json", (0, 0))
    torn = expire_torn_records(tmp_path, ["d.json", "missing.json"], now=TORN_RECORD_MAX_AGE_S * 2)
    assert (torn.removed, torn.kept) == ([], ["d.json"])


@pytest.mark.parametrize(
    "body",
    [
        {"start": 5},
        {"start": "../../x"},  # would have named a rollup outside rollups/
        {"start": "2026-13-01T00:00:00Z"},
        {"env": 7},
        {"env": ""},
        {"user": None},
        {"force_calls": "many"},
        {"force_calls": -1},
        {"force_calls": True},
        {"force_calls": 1.5},
    ],
    ids=repr,
)
def test_a_record_with_bad_fields_is_skipped_never_counted_or_crashing(layout, body):
    spool = layout.usage_dir
    drop(spool, "good.json", record())
    drop(spool, "bad.json", dict(record(), **body))
    report = usage_report(layout)
    assert report["unreadable_records"] == 1 and report["totals"]["sessions"] == 1
    result = compact(layout)
    assert (result.folded, result.torn_kept) == (1, 1)
    assert (spool / "bad.json").exists()
    assert sorted(p.name for p in (spool / "rollups").iterdir()) == [
        ".compact.lock",
        "2026-11.json",
    ]
    assert not list(layout.root.glob("*.json"))


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps(record()).replace('"force_calls": 3', '"force_calls": NaN').encode(),
        json.dumps(record()).replace('"force_calls": 3', '"force_calls": 1e999').encode(),
        json.dumps(record(env="\u00e9mt"), ensure_ascii=False).encode("latin-1"),
        json.dumps(dict(record(), padding="x" * RECORD_MAX_BYTES)).encode(),
    ],
    ids=["deep", "nan", "huge-number", "not-utf8", "too-big"],
)
def test_records_go_through_the_strict_reader(layout, raw):
    (layout.usage_dir / "r.json").write_bytes(raw)
    assert read_records(layout.usage_dir) == ({}, ["r.json"])


def test_record_size_bound_is_far_above_a_real_record(layout):
    assert len(json.dumps(record())) * 100 < RECORD_MAX_BYTES


record_like = st.fixed_dictionaries(
    {},
    optional={
        key: st.just(value) | json_values
        for key, value in {**record(), "start": "2026-11-05T10:00:00Z"}.items()
    },
)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=200)
    | json_values.map(lambda v: json.dumps(v).encode())
    | record_like.map(lambda v: json.dumps(v).encode())
)
def test_fuzz_record_bytes_parse_or_are_refused_cleanly(raw):
    try:
        parsed = parse_record(raw)
    except ParseProblem:
        return
    assert re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])", record_month(parsed))
    (tally,) = tally_records([parsed]).values()  # whatever is accepted can be counted
    assert tally.sessions == 1
