"""Ingest and read models of the dashboard against a real SQLite file.

The tables come from ``Base.metadata.create_all`` (the migrations are tested with
the server); everything else is the real code path the API uses.
"""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("sqlalchemy")

from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from rootstock.dashboard import views
from rootstock.dashboard.ingest import ManifestShapeError, store_push, store_usage
from rootstock.dashboard.models import (
    Base,
    Cluster,
    CoverageCell,
    ManifestPush,
    UsageCount,
    VerificationEvent,
)
from tests.dashboard.manifests import large, manifest, record


@pytest.fixture
def sessions(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'dash.sqlite3'}")
    Base.metadata.create_all(engine)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


def add_cluster(session: Session, name: str) -> Cluster:
    cluster = Cluster(name=name)
    session.add(cluster)
    session.flush()
    return cluster


def push(sessions, name: str, body: dict) -> ManifestPush:
    with sessions() as session:
        cluster = session.execute(select(Cluster).where(Cluster.name == name)).scalar()
        cluster = cluster or add_cluster(session, name)
        stored = store_push(session, cluster, body, None)
        session.commit()
        return stored


def cells(sessions, **filters) -> dict[tuple[str, str], str]:
    """(checkpoint, cluster) -> state, from the coverage view."""
    with sessions() as session:
        matrix = views.coverage(session, **filters)
    return {
        (row["checkpoint"], name): cell["state"]
        for row in matrix["checkpoints"]
        for name, cell in row["cells"].items()
    }


MIXED = {
    "mace": {
        "mace-small": {"gpu": record("mace")},
        "mace-large": {"gpu": record("mace", "failed", message="CUDA out of memory")},
        "mace-medium": {},
        "mace-off": None,
    },
    "chgnet": {"chgnet-0.3.0": {"cpu": record("chgnet", "drifted", kind="cpu")}},
}


def test_push_fills_coverage_with_each_state(sessions):
    stored = push(sessions, "delta", manifest("delta", MIXED))
    assert (stored.env_count, stored.checkpoint_count) == (2, 5)
    assert cells(sessions) == {
        ("mace-small", "delta"): "verified",
        ("mace-large", "delta"): "failed",
        ("mace-medium", "delta"): "fetched",
        ("mace-off", "delta"): "not fetched",
        ("chgnet-0.3.0", "delta"): "drifted",
    }
    with sessions() as session:
        matrix = views.coverage(session)
        assert matrix["families"] == ["chgnet", "mace"]
        assert [c["name"] for c in matrix["clusters"]] == ["delta"]
        # rows sorted by family, then id
        assert [r["checkpoint"] for r in matrix["checkpoints"]] == [
            "chgnet-0.3.0",
            "mace-large",
            "mace-medium",
            "mace-off",
            "mace-small",
        ]
        small = next(r for r in matrix["checkpoints"] if r["checkpoint"] == "mace-small")
        assert small["family"] == "mace"
        assert small["cells"]["delta"] == {
            "env": "mace",
            "state": "verified",
            "verified_at": "2026-11-28T10:00:00+00:00",
            "device_kind": "gpu",
            "message": None,
        }


def test_second_push_replaces_the_first(sessions):
    push(sessions, "delta", manifest("delta", MIXED))
    smaller = copy.deepcopy(MIXED)
    del smaller["mace"]["mace-large"]
    del smaller["chgnet"]
    second = push(sessions, "delta", manifest("delta", smaller))
    assert set(cells(sessions)) == {
        ("mace-small", "delta"),
        ("mace-medium", "delta"),
        ("mace-off", "delta"),
    }
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(ManifestPush)) == 2
        latest = views.latest_manifest(session, "delta")
        assert latest["push_id"] == second.id
        assert "chgnet" not in latest["manifest"]["envs"]
        history = views.push_history(session, "delta")
        assert [p["checkpoints"] for p in history["pushes"]] == [3, 5]
        assert views.cluster_list(session)["clusters"] == [
            {
                "name": "delta",
                "last_push_at": history["pushes"][0]["received_at"],
                "envs": 1,
                "checkpoints": 3,
            }
        ]


def test_the_body_as_received_is_kept(sessions):
    body = manifest("delta", {"mace": {"mace-small": {}}})
    text = json.dumps(body, indent=1)
    with sessions() as session:
        cluster = add_cluster(session, "delta")
        stored = store_push(session, cluster, body, None, body=text)
        session.commit()
        assert session.get(ManifestPush, stored.id).body == text
        assert views.latest_manifest(session, "delta")["manifest"] == body


def test_repeated_verifications_are_stored_once(sessions):
    body = manifest("delta", {"mace": {"mace-small": {"gpu": record("mace")}}})
    push(sessions, "delta", body)
    push(sessions, "delta", body)
    later = manifest(
        "delta",
        {
            "mace": {
                "mace-small": {
                    "gpu": record("mace", "drifted", at="2026-11-29T10:00:00+00:00", energy=-3.8),
                    "cpu": record("mace", at="2026-11-29T09:00:00+00:00", kind="cpu"),
                }
            }
        },
    )
    push(sessions, "delta", later)
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(VerificationEvent)) == 3
        detail = views.cluster_detail(session, "delta")
    (row,) = detail["checkpoints"]
    assert row["state"] == "drifted"  # the newest record of any kind
    assert [(h["device_kind"], h["state"], h["at"]) for h in row["history"]] == [
        ("gpu", "drifted", "2026-11-29T10:00:00+00:00"),
        ("cpu", "verified", "2026-11-29T09:00:00+00:00"),
        ("gpu", "verified", "2026-11-28T10:00:00+00:00"),
    ]
    assert row["history"][0]["energy_per_atom"] == -3.8
    with sessions() as session:
        (short,) = views.cluster_detail(session, "delta", history_limit=2)["checkpoints"]
    assert short["history"] == row["history"][:2]


def test_rebuilt_env_makes_its_verifications_stale(sessions):
    body = manifest("delta", {"mace": {"mace-small": {"gpu": record("mace")}}})
    body["envs"]["mace"]["built_at"] = "2026-11-29T00:00:00+00:00"  # rebuilt afterwards
    push(sessions, "delta", body)
    assert cells(sessions) == {("mace-small", "delta"): "stale"}
    with sessions() as session:
        (row,) = views.coverage(session)["checkpoints"]
    assert "rebuilt" in row["cells"]["delta"]["message"]


def test_hotfixed_source_makes_its_verifications_stale(sessions):
    body = manifest("delta", {"mace": {"mace-small": {"gpu": record("mace")}}})
    body["envs"]["mace"]["source_hash"] = "sha256:hotfix"
    push(sessions, "delta", body)
    assert cells(sessions) == {("mace-small", "delta"): "stale"}


def test_filters_narrow_rows_and_columns(sessions):
    push(sessions, "delta", manifest("delta", MIXED))
    push(sessions, "polaris", manifest("polaris", {"mace": {"mace-small": {}}}))
    assert set(cells(sessions, family="chgnet")) == {("chgnet-0.3.0", "delta")}
    # state keeps rows with at least one cell in it, with all their cells
    assert cells(sessions, state="fetched") == {
        ("mace-medium", "delta"): "fetched",
        ("mace-small", "delta"): "verified",
        ("mace-small", "polaris"): "fetched",
    }
    assert cells(sessions, cluster="polaris") == {("mace-small", "polaris"): "fetched"}
    assert cells(sessions, cluster="polaris", state="verified") == {}
    with sessions() as session:
        narrowed = views.coverage(session, family="chgnet", cluster="delta")
    assert [c["name"] for c in narrowed["clusters"]] == ["delta"]
    assert narrowed["families"] == ["chgnet", "mace"]  # the form still offers every family
    assert cells(sessions, family="nope") == {}


def test_clusters_that_never_pushed_have_no_column(sessions):
    with sessions() as session:
        add_cluster(session, "idle")
        session.commit()
        assert views.coverage(session)["clusters"] == []
        assert views.latest_manifest(session, "idle") is None
        assert views.push_history(session, "idle") == {"cluster": "idle", "pushes": []}
        assert views.cluster_detail(session, "idle")["envs"] == []
        assert views.latest_manifest(session, "unknown") is None
        assert views.push_history(session, "unknown") is None
        assert views.cluster_detail(session, "unknown") is None


def test_cluster_detail_lists_env_versions_and_retired_history(sessions):
    push(sessions, "delta", manifest("delta", MIXED))
    later = {"mace": {"mace-small": {"gpu": record("mace")}}}
    push(sessions, "delta", manifest("delta", later, python="3.12.1", torch=None))
    with sessions() as session:
        detail = views.cluster_detail(session, "delta")
    (env,) = detail["envs"]
    assert (env["name"], env["python"], env["torch"], env["rootstock"]) == (
        "mace",
        "3.12.1",
        None,
        "0.1.0",
    )
    assert env["checkpoints"] == 1
    assert [c["checkpoint"] for c in detail["checkpoints"]] == ["mace-small"]
    assert {(r["env"], r["checkpoint"]) for r in detail["retired"]} == {
        ("chgnet", "chgnet-0.3.0"),
        ("mace", "mace-large"),
    }


def test_usage_resend_replaces_the_month(sessions):
    def counts(sessions_):
        return [
            {
                "month": "2026-11",
                "env": "mace",
                "checkpoint": "mace-small",
                "sessions": sessions_,
                "distinct_users": 2,
                "force_calls": 100,
            },
            {
                "month": "2026-10",
                "env": "mace",
                "checkpoint": "mace-small",
                "sessions": 1,
                "distinct_users": 1,
                "force_calls": 5,
            },
        ]

    with sessions() as session:
        delta = add_cluster(session, "delta")
        polaris = add_cluster(session, "polaris")
        assert store_usage(session, delta, counts(12)) == 2
        assert store_usage(session, delta, counts(12)) == 2  # a retry: same numbers
        store_usage(session, polaris, counts(3)[:1])
        session.commit()
        summary = views.usage_summary(session)
        assert summary["months"] == ["2026-11", "2026-10"]
        (november,) = summary["by_month"]["2026-11"]
        assert (november["sessions"], november["distinct_users"], november["clusters"]) == (
            15,
            4,
            2,
        )
        # re-sending November with another checkpoint drops the old November row
        store_usage(
            session,
            delta,
            [
                {
                    "month": "2026-11",
                    "env": "orb",
                    "checkpoint": "orb-v3",
                    "sessions": 4,
                    "distinct_users": 1,
                    "force_calls": 0,
                }
            ],
        )
        session.commit()
        rows = session.execute(
            select(UsageCount.month, UsageCount.checkpoint).where(UsageCount.cluster_id == delta.id)
        ).all()
        assert sorted(rows) == [("2026-10", "mace-small"), ("2026-11", "orb-v3")]


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda m: m.update(envs=[]), "envs must be an object"),
        (lambda m: m.update(schema_version="1"), "schema_version"),
        (lambda m: m["envs"]["mace"].update(checkpoints=[1]), "checkpoints must be an object"),
        (lambda m: m["envs"]["mace"].update(python=3.11), "python"),
        (lambda m: m["envs"].update({"x" * 201: {}}), "env names"),
        (
            lambda m: m["envs"]["mace"]["checkpoints"]["mace-small"]["verifications"][
                "delta"
            ].update(gpu="yes"),
            "must be an object",
        ),
    ],
)
def test_unusable_shapes_are_refused_before_any_write(sessions, mutate, fragment):
    body = manifest("delta", {"mace": {"mace-small": {"gpu": record("mace")}}})
    mutate(body)
    with sessions() as session:
        cluster = add_cluster(session, "delta")
        with pytest.raises(ManifestShapeError, match=fragment):
            store_push(session, cluster, body, None)
        assert cluster.last_push_id is None
        assert session.scalar(select(func.count()).select_from(ManifestPush)) == 0


def test_large_push_and_matrix(sessions):
    for index in range(3):
        push(sessions, f"c{index}", large(f"c{index}"))
    with sessions() as session:
        matrix = views.coverage(session)
        assert len(matrix["checkpoints"]) == 300
        assert all(len(row["cells"]) == 3 for row in matrix["checkpoints"])
        assert session.scalar(select(func.count()).select_from(CoverageCell)) == 900
