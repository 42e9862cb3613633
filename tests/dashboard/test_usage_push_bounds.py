"""``usage push`` against the real dashboard: nothing a local user writes into the spool
can make it refuse the push.

A spool holding records past the dashboard's bounds, a rollup written before the
client checked them, and good records whose force calls sum past 2**31-1 is pushed
to a live ``rootstock dashboard serve`` (SQLite) before and after ``usage compact``.
Before the bounds, the first push got a 422 and, once compacted, so did every later
one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from rootstock.dashboard.models import Cluster, UsageCount
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import ensure_manifest
from rootstock.install.usage import COUNT_MAX
from rootstock.ops.http_client import RetryPolicy
from rootstock.ops.push import Dashboard, push_usage
from rootstock.ops.usage import Rollup, compact
from tests.dashboard.conftest import Dashboard as LiveDashboard

pytestmark = pytest.mark.timeout(300)

POLICY = RetryPolicy(attempt_timeout=20.0, total_cap=60.0, first_delay=0.1, max_delay=1.0)


def record(env: str = "emt", user: str = "u1", calls: int | str = 3) -> str:
    """A record's raw JSON (``calls`` as text, so any integer fits)."""
    return (
        f'{{"version": 1, "env": {json.dumps(env)}, "checkpoint": "emt", "device": "cpu", '
        f'"entry_point": "calculator", "start": "2026-11-05T10:00:00Z", "duration_s": 1.0, '
        f'"force_calls": {calls}, "user": {json.dumps(user)}}}'
    )


def stored(live: LiveDashboard, cluster: str) -> dict[str, tuple[int, int, int]]:
    """The dashboard's usage rows for ``cluster``: env -> (sessions, users, force calls)."""
    with live._sessions() as session:
        cluster_id = session.scalars(select(Cluster.id).where(Cluster.name == cluster)).one()
        rows = session.scalars(select(UsageCount).where(UsageCount.cluster_id == cluster_id))
        return {r.env: (r.sessions, r.distinct_users, r.force_calls) for r in rows}


def test_hostile_records_and_a_poisoned_rollup_never_block_the_push(
    sqlite_dashboard: LiveDashboard, tmp_path: Path
):
    cluster, _ = sqlite_dashboard.cluster_with_key("usage")
    key, secret = sqlite_dashboard.issue_key(cluster)
    target = Dashboard(sqlite_dashboard.url.rstrip("/"), key, secret, POLICY)
    layout = InstallLayout(root=tmp_path, cache_root=tmp_path)
    spool = layout.usage_dir
    spool.mkdir()
    ensure_manifest(layout, [cluster])

    (spool / "huge.json").write_text(record(calls=str(2**62)))
    (spool / "long.json").write_text(record(env="e" * 5000))
    (spool / "nul.json").write_text(record(env="em\x00t"))
    for i in range(3):  # good records whose sum passes 2**31-1
        (spool / f"big{i}.json").write_text(record(env="big", user=f"u{i}", calls=COUNT_MAX))
    rollup = Rollup("2026-11")  # as compact wrote it before the bounds
    rollup.fold("old1.json", json.loads(record(user="x")))
    rollup.fold("old2.json", json.loads(record(env="mace", calls=str(2**62))))
    rollup.fold("old3.json", json.loads(record(env="c" * 300)))
    rollup.pending.clear()
    (spool / "rollups").mkdir()
    (spool / "rollups" / "2026-11.json").write_text(json.dumps(rollup.to_json()))

    for step in ("before compact", "after compact", "again"):
        report = push_usage(layout, cluster, dashboard=target)
        assert report.ok, (step, report.to_dict())
        assert stored(sqlite_dashboard, cluster) == {
            "emt": (1, 1, 3),
            "mace": (1, 1, COUNT_MAX),
            "big": (3, 3, COUNT_MAX),
        }, step
        if step == "before compact":
            result = compact(layout)
            assert result.folded == 3 and result.torn_kept == 3
            assert len(result.repaired["2026-11"]) == 2
