"""Usage counts and names the dashboard refuses can never block ``usage push``.

Anyone can write into the spool, so a record may carry a count or a name past what
the dashboard stores (``rootstock.dashboard.schemas``: counts up to 2**31-1, names
up to 200 characters, no NUL, no lone surrogate). Such a record is unreadable:
counted as such, never folded. A rollup that already holds one (written before
this check existed) is left out of the report and repaired by ``compact``. Sums of
good records past 2**31-1 are capped in the push. Every payload below is checked
with the dashboard's own request model, in-process; the real server takes the
same payloads in tests/dashboard/test_usage_push_bounds.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.dashboard.schemas import UsageIn
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import ensure_manifest
from rootstock.install.usage import COUNT_MAX, NAME_MAX, read_records
from rootstock.ops.http_client import RetryPolicy
from rootstock.ops.push import Dashboard, push_usage
from rootstock.ops.usage import Rollup, compact, load_rollups, usage_report
from tests.unit.push_stand_in import StandIn, serve
from tests.unit.usage_spool import drop, make_layout, record, rollup_file, run_usage

pytestmark = pytest.mark.timeout(120)

FAST = RetryPolicy(attempt_timeout=5.0, total_cap=10.0, first_delay=0.01, max_delay=0.05)


@pytest.fixture
def layout(tmp_path, monkeypatch) -> InstallLayout:
    layout = make_layout(tmp_path, monkeypatch)
    ensure_manifest(layout, ["alpha"])
    return layout


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    yield from serve()


def pushed(layout: InstallLayout, stand_in: StandIn) -> dict:
    """Push to the stand-in; the body it got, checked with the dashboard's own model."""
    report = push_usage(layout, dashboard=Dashboard(stand_in.url, "rk", "s", FAST))
    assert report.ok, report.to_dict()
    body = stand_in.seen[-1].json()
    UsageIn.model_validate(body)  # raises as the dashboard's 422 would
    return body


def test_the_bounds_are_the_dashboards():
    from rootstock.dashboard.models import NAME
    from rootstock.dashboard.schemas import INT32

    assert (COUNT_MAX, NAME_MAX) == (INT32, NAME)


def raw_with(**fields) -> str:
    """A record's JSON with ``fields`` replaced (raw text, so lone surrogates survive)."""
    text = json.dumps(record())
    for key, value in fields.items():
        text = text.replace(f'"{key}": {json.dumps(record()[key])}', f'"{key}": {value}')
    return text


OUT_OF_BOUNDS = {
    "calls-2**62": raw_with(force_calls=str(2**62)),
    "calls-int32+1": raw_with(force_calls=str(COUNT_MAX + 1)),
    "env-5000": raw_with(env=json.dumps("e" * 5000)),
    "checkpoint-201": raw_with(checkpoint=json.dumps("c" * (NAME_MAX + 1))),
    "user-5000": raw_with(user=json.dumps("u" * 5000)),
    "env-nul": raw_with(env='"em\\u0000t"'),
    "checkpoint-surrogate": raw_with(checkpoint='"emt\\ud800"'),
    "start-arabic-digits": raw_with(start='"\\u0662\\u0660\\u0662\\u0666-11-05T10:00:00Z"'),
}


@pytest.mark.parametrize("raw", OUT_OF_BOUNDS.values(), ids=OUT_OF_BOUNDS.keys())
def test_an_out_of_bounds_record_is_unreadable_never_folded_never_pushed(
    layout, stand_in, capsys, raw
):
    spool = layout.usage_dir
    drop(spool, "good.json", record())
    drop(spool, "bad.json", raw)
    report = usage_report(layout)
    assert report["unreadable_records"] == 1
    assert report["totals"] == {"users": 1, "sessions": 1, "force_calls": 3}
    body = pushed(layout, stand_in)
    assert [(c["env"], c["sessions"], c["force_calls"]) for c in body["counts"]] == [("emt", 1, 3)]
    code, out = run_usage(capsys, layout, "compact")
    assert code == 0, out
    assert "1 unreadable record(s) skipped and kept" in out
    assert (spool / "bad.json").exists() and not (spool / "good.json").exists()
    (group,) = load_rollups(spool)["2026-11"].groups.values()
    assert (group.sessions, group.force_calls) == (1, 3)
    pushed(layout, stand_in)


def test_records_at_the_bounds_are_counted(layout, stand_in):
    edge = dict(record(), env="e" * NAME_MAX, checkpoint="c" * NAME_MAX, force_calls=COUNT_MAX)
    drop(layout.usage_dir, "edge.json", edge)
    assert read_records(layout.usage_dir)[1] == []
    (count,) = pushed(layout, stand_in)["counts"]
    assert (len(count["env"]), count["force_calls"]) == (NAME_MAX, COUNT_MAX)


def test_sums_past_int32_are_capped_in_the_push_and_said(layout, stand_in, capsys):
    for i in range(3):
        drop(layout.usage_dir, f"r{i}.json", record(user=f"u{i}", calls=COUNT_MAX))
    assert usage_report(layout)["totals"]["force_calls"] == 3 * COUNT_MAX  # the true sum
    compact(layout)
    assert usage_report(layout)["totals"]["force_calls"] == 3 * COUNT_MAX
    report = push_usage(layout, dashboard=Dashboard(stand_in.url, "rk", "s", FAST))
    (count,) = stand_in.seen[-1].json()["counts"]
    UsageIn.model_validate(stand_in.seen[-1].json())
    assert (count["sessions"], count["force_calls"]) == (3, COUNT_MAX)
    (result,) = report.results
    assert result.ok and "1 count(s)" in result.message and str(COUNT_MAX) in result.message


def poisoned_rollup(layout: InstallLayout) -> Path:
    """A rollup as compact wrote it before the bounds: a 5,000-character env, a 2**62."""
    rollup = Rollup("2026-11")
    rollup.fold("a.json", record(user="x"))
    rollup.fold("b.json", record(user="y", env="e" * 5000))
    rollup.fold("c.json", record(user="z", env="mace", calls=2**62))
    rollup.fold("d.json", record(user="y", env="mace", calls=5))
    rollup.pending.clear()
    path = rollup_file(layout)
    path.parent.mkdir()
    path.write_text(json.dumps(rollup.to_json()))
    return path


def test_a_poisoned_rollup_never_blocks_a_push_and_compact_repairs_it(layout, stand_in, capsys):
    path = poisoned_rollup(layout)
    report = usage_report(layout)
    assert report["rollup_entries_out_of_bounds"] == 2
    assert [(r["env"], r["sessions"]) for r in report["rows"]] == [("emt", 1), ("mace", 2)]
    mace = report["rows"][1]
    assert mace["force_calls"] == 2 * COUNT_MAX  # two sessions, each at most 2**31-1
    code, out = run_usage(capsys, layout, "report")
    assert code == 0 and "2 rollup entr" in out and "usage compact" in out
    body = pushed(layout, stand_in)
    assert [(c["env"], c["force_calls"]) for c in body["counts"]] == [
        ("emt", 3),
        ("mace", COUNT_MAX),
    ]

    code, out = run_usage(capsys, layout, "compact")
    assert code == 0, out
    assert "repaired usage rollup" in out and "2026-11" in out
    assert "dropped" in out and "capped" in out
    data = json.loads(path.read_text())
    assert [g["env"] for g in data["groups"]] == ["emt", "mace"]
    assert data["groups"][1]["force_calls"] == 2 * COUNT_MAX
    assert data["folded_count"] == 3  # the dropped session is no longer counted
    assert usage_report(layout)["rollup_entries_out_of_bounds"] == 0
    code, out = run_usage(capsys, layout, "compact")
    assert code == 0 and "repaired" not in out
    pushed(layout, stand_in)


def test_a_usage_422_names_compact_not_the_manifest_schema(layout, stand_in):
    drop(layout.usage_dir, "a.json", record())
    stand_in.script = [(422, {"detail": [{"loc": ["body", "counts", 0], "msg": "bad"}]})]
    report = push_usage(layout, dashboard=Dashboard(stand_in.url, "rk", "s", FAST))
    error = report.error()
    assert "rejected the usage" in str(error)
    assert "usage compact" in (error.hint or "") and "manifest schema" not in (error.hint or "")
