"""The catalogue read model and the ``tampered`` state, against a real SQLite file.

Pushes go through ``store_push`` (the API's own path); the catalogue is read back with
:func:`rootstock.dashboard.catalogue.catalogue`, the function behind
``GET /api/v1/catalogue`` and the ``/catalogue`` page.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sqlalchemy")

from sqlalchemy import create_engine, select, update
from sqlalchemy.orm import sessionmaker

from rootstock.dashboard import views
from rootstock.dashboard.catalogue import catalogue
from rootstock.dashboard.ingest import ManifestShapeError, store_push
from rootstock.dashboard.models import Base, Cluster, CoverageCell
from tests.dashboard.manifests import manifest, record

MACE_INFO = {"licence": "MIT", "gated": None, "citation": "arXiv:2401.00096"}
UMA_INFO = {"licence": "LicenseRef-FAIR-Chem", "gated": "https://huggingface.co/facebook/UMA"}
TAMPERED = (
    "weights of uma-s-1p1 changed since add: cache/uma/uma-s-1p1.pt sha256 3f2a… ≠ 9b41… "
    "(size 11 MB → 11 MB); re-run rootstock add uma-s-1p1 to accept the new file"
)


@pytest.fixture
def sessions(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'dash.sqlite3'}")
    Base.metadata.create_all(engine)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


def push(sessions, name: str, body: dict) -> None:
    with sessions() as session:
        cluster = session.execute(select(Cluster).where(Cluster.name == name)).scalar()
        if cluster is None:
            cluster = Cluster(name=name)
            session.add(cluster)
            session.flush()
        store_push(session, cluster, body, None)
        session.commit()


def described(body: dict, env: str, checkpoint: str, info: dict) -> dict:
    """``body`` with ``info`` on one checkpoint, as ``rootstock manifest push`` sends it."""
    body["envs"][env]["checkpoints"][checkpoint]["info"] = dict(info)
    return body


def read(sessions) -> dict[str, dict]:
    with sessions() as session:
        found = catalogue(session)
    assert found["version"] == 1
    return {entry["checkpoint"]: entry for entry in found["checkpoints"]}


def test_each_checkpoint_with_its_info_and_where_it_is_verified(sessions):
    delta = manifest(
        "delta",
        {
            "mace": {
                "mace-small": {
                    "gpu": record("mace"),
                    "cpu": record("mace", "failed", kind="cpu", message="CUDA OOM"),
                }
            },
            "uma": {"uma-s-1p1": {"gpu": record("uma", "tampered", message=TAMPERED)}},
        },
    )
    described(delta, "mace", "mace-small", MACE_INFO)
    described(delta, "uma", "uma-s-1p1", UMA_INFO)
    push(sessions, "delta", delta)
    # An older client: no info at all; its cells are still listed.
    push(sessions, "polaris", manifest("polaris", {"mace": {"mace-small": {"cpu": record(
        "mace", kind="cpu", at="2026-11-27T09:00:00+02:00")}, "mace-off": None}}))  # fmt: skip

    entries = read(sessions)
    assert list(entries) == ["mace-off", "mace-small", "uma-s-1p1"]  # family, then id
    small = entries["mace-small"]
    assert {k: small[k] for k in ("family", "described", *MACE_INFO)} == {
        "family": "mace",
        "described": True,
        **MACE_INFO,
    }
    assert small["verified_on"] == ["delta", "polaris"]
    by_cluster = {c["cluster"]: c for c in small["clusters"]}
    assert by_cluster["delta"]["devices"] == [
        {"device_kind": "cpu", "device": "cpu", "state": "failed",
         "at": "2026-11-28T10:00:00+00:00", "message": "CUDA OOM"},
        {"device_kind": "gpu", "device": "cuda:0", "state": "verified",
         "at": "2026-11-28T10:00:00+00:00", "message": None},
    ]  # fmt: skip
    # Times in UTC, whatever offset the cluster wrote.
    assert by_cluster["polaris"]["devices"][0]["at"] == "2026-11-27T07:00:00+00:00"

    uma = entries["uma-s-1p1"]
    assert uma["gated"] == UMA_INFO["gated"] and uma["citation"] is None
    assert uma["verified_on"] == []
    (place,) = uma["clusters"]
    assert place["state"] == "tampered" and place["message"] == TAMPERED
    assert place["devices"][0]["state"] == "tampered"
    assert place["devices"][0]["message"] == TAMPERED

    off = entries["mace-off"]  # only the older client has it: unknown, not "open"
    assert off["described"] is False
    assert (off["licence"], off["gated"], off["citation"]) == (None, None, None)
    assert off["clusters"] == [
        {"cluster": "polaris", "env": "mace", "state": "not fetched", "message": None,
         "devices": []}
    ]  # fmt: skip


def test_info_comes_from_the_newest_push_that_described_it(sessions):
    body = {"mace": {"mace-small": {"gpu": record("mace")}}}
    push(sessions, "delta", described(manifest("delta", body), "mace", "mace-small", MACE_INFO))
    newer = {**MACE_INFO, "licence": "Apache-2.0"}
    push(sessions, "polaris", described(manifest("polaris", body), "mace", "mace-small", newer))
    push(sessions, "aurora", manifest("aurora", body))  # newest, but says nothing
    small = read(sessions)["mace-small"]
    assert small["licence"] == "Apache-2.0"
    assert small["verified_on"] == ["aurora", "delta", "polaris"]


def test_a_device_verified_on_an_older_build_is_stale_not_verified(sessions):
    body = manifest("delta", {"mace": {"mace-small": {"gpu": record("mace")}}})
    body["envs"]["mace"]["built_at"] = "2026-11-29T00:00:00+00:00"  # rebuilt since
    push(sessions, "delta", body)
    small = read(sessions)["mace-small"]
    assert small["verified_on"] == []
    (device,) = small["clusters"][0]["devices"]
    assert device["state"] == "stale" and "rebuilt" in device["message"]


def test_cells_stored_before_the_devices_column_stand_in_for_it(sessions):
    push(sessions, "delta", manifest("delta", {"mace": {"mace-small": {"gpu": record("mace")}}}))
    with sessions() as session:  # what revision 0004 leaves on an existing row
        session.execute(update(CoverageCell).values(devices=None, described=False))
        session.commit()
    small = read(sessions)["mace-small"]
    assert small["described"] is False and small["verified_on"] == ["delta"]
    assert small["clusters"][0]["devices"] == [
        {"device_kind": "gpu", "device": "cuda:0", "state": "verified",
         "at": "2026-11-28T10:00:00+00:00", "message": None}
    ]  # fmt: skip


def test_tampered_is_shown_like_failed_with_its_reason(sessions):
    tampered = record("uma", "tampered", message=TAMPERED)
    body = manifest("delta", {"uma": {"uma-s-1p1": {"gpu": tampered}}})
    push(sessions, "delta", body)
    with sessions() as session:
        coverage = views.coverage(session, state="tampered")
        detail = views.cluster_detail(session, "delta")
    (row,) = coverage["checkpoints"]
    assert row["cells"]["delta"]["state"] == "tampered"
    assert row["cells"]["delta"]["message"] == TAMPERED
    assert detail is not None
    (cell,) = detail["checkpoints"]
    assert (cell["state"], cell["message"]) == ("tampered", TAMPERED)
    assert [(e["state"], e["message"]) for e in cell["history"]] == [("tampered", TAMPERED)]


@pytest.mark.parametrize(
    ("info", "fragment"),
    [
        ("MIT", r"\.info must be an object"),
        ({"licence": 3}, r"\.info\.licence: must be text of at most 500"),
        ({"gated": "https://x/" + "a" * 500}, r"\.info\.gated: must be text"),
    ],
)
def test_an_unusable_info_is_refused_before_any_write(sessions, info, fragment):
    body = manifest("delta", {"mace": {"mace-small": {"gpu": record("mace")}}})
    body["envs"]["mace"]["checkpoints"]["mace-small"]["info"] = info
    with pytest.raises(ManifestShapeError, match=fragment):
        push(sessions, "delta", body)
    assert read(sessions) == {}


def test_the_devices_column_is_compact_json(sessions):
    push(sessions, "delta", manifest("delta", {"mace": {"mace-small": {"gpu": record("mace")}}}))
    with sessions() as session:
        stored = session.scalar(select(CoverageCell.devices))
    assert stored is not None and " " not in stored
    assert json.loads(stored)["gpu"]["state"] == "verified"
