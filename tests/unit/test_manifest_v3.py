"""Manifest schema 3 (issue 30): an env's squashfs ``image`` and a verification's ``staged``.

A v2 file migrates to v3 with ``image: null``; an image is checked field by field on
read (each refusal names its JSON path) and before ``record_env_build`` takes the
lock; ``record_verification`` stores ``staged``; and the dashboard accepts a v3 push
(validated as the API does, stored in SQLite) as it still accepts a v2 one.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rootstock.errors import ManifestError
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    MANIFEST_VERSION,
    load_manifest,
    parse_manifest,
    record_env_build,
    record_verification,
)
from rootstock.install.manifest.migrations import MIGRATIONS
from rootstock.install.manifest.validate import image_problem

pytestmark = pytest.mark.timeout(120)

T0 = "2026-11-01T08:00:00+00:00"
T1 = "2026-11-28T10:00:00+00:00"
IMAGE = {
    "file": ".rootstock-image.sqfs",
    "sha256": "3f6c" * 16,
    "size": 2_147_483_648,
    "compression": "zstd-3",
}
BUILD = {"build_id": "b1", "source_hash": "sha256:9b", "built_at": T0, "lock_hash": "sha256:47"}
FP = {"energy_per_atom": -3.9, "force_norm": 1.2, "stress": None, "natoms": 8}
RECORD = {
    "state": "verified",
    "at": T1,
    "device": "cuda:0",
    "device_kind": "gpu",
    "message": None,
    "kwargs": {},
    "fingerprint": FP,
    "reference": {"fingerprint": FP, "at": T1, "build": BUILD, "kwargs": {}},
    "references": {"{}": {"fingerprint": FP, "at": T1, "build": BUILD, "kwargs": {}}},
    "drift": None,
    "build": BUILD,
}


def v2_manifest() -> dict[str, Any]:
    """A version-2 file: two envs, one with a verified checkpoint."""
    env = {**BUILD, "python": "3.11.9", "python_path": "/usr/bin/python3", "torch": None}
    return copy.deepcopy(
        {
            "schema_version": 2,
            "clusters": ["alpha"],
            "created_at": T0,
            "updated_at": T1,
            "written_by": "rootstock 0.1.0",
            "envs": {
                "emt": {
                    **env,
                    "rootstock": "0.1.0",
                    "checkpoints": {
                        "emt-a": {"fetched_at": T0, "verifications": {"alpha": {"gpu": RECORD}}}
                    },
                },
                "mace": {**env, "rootstock": "0.1.0", "checkpoints": {}},
            },
        }
    )


def v3_manifest(image: Any = IMAGE) -> dict[str, Any]:
    """The same file in version 3, ``envs["emt"].image`` set to ``image``."""
    data = v2_manifest()
    data["schema_version"] = 3
    data["envs"]["emt"]["image"] = copy.deepcopy(image)
    data["envs"]["mace"]["image"] = None
    data["envs"]["emt"]["checkpoints"]["emt-a"]["verifications"]["alpha"]["gpu"]["staged"] = "mount"
    return data


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "user" / "config.toml"))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    root = tmp_path / "root"
    (root / ".locks").mkdir(parents=True)
    return InstallLayout(root, root)


# --- migration ----------------------------------------------------------------------------


def test_version_3_is_known_and_2_migrates_to_it():
    assert MANIFEST_VERSION >= 3
    assert 2 in MIGRATIONS


def test_a_v2_file_migrates_to_v3_with_no_image():
    data = parse_manifest(json.dumps(v2_manifest()))
    assert data["schema_version"] == MANIFEST_VERSION
    assert {name: env["image"] for name, env in data["envs"].items()} == {
        "emt": None,
        "mace": None,
    }
    # Records gain nothing: an absent ``staged`` reads as null (the shared env).
    record = data["envs"]["emt"]["checkpoints"]["emt-a"]["verifications"]["alpha"]["gpu"]
    assert record == RECORD
    # Everything else is as it was.
    expected = v2_manifest()
    for env in expected["envs"].values():
        env["image"] = None
    assert data == {**expected, "schema_version": MANIFEST_VERSION}


def test_a_v2_file_is_read_without_a_write_and_written_back_as_v3(layout: InstallLayout):
    text = json.dumps(v2_manifest())
    layout.manifest_file.write_text(text)
    assert load_manifest(layout)["envs"]["emt"]["image"] is None
    assert layout.manifest_file.read_text() == text
    record_verification(layout, "mace", "m", "alpha", {"passed": False, "message": "boom"})
    on_disk = json.loads(layout.manifest_file.read_text())
    assert on_disk["schema_version"] == MANIFEST_VERSION
    assert on_disk["envs"]["emt"]["image"] is None and on_disk["envs"]["mace"]["image"] is None


def test_a_v1_file_migrates_through_v2_to_v3():
    v1 = {"schema_version": 1, "clusters": ["alpha"], "envs": {"emt": {"checkpoints": {}}}}
    data = parse_manifest(json.dumps(v1))
    assert data["schema_version"] == MANIFEST_VERSION and data["envs"]["emt"]["image"] is None


# --- the image on read --------------------------------------------------------------------


def test_a_valid_image_and_staged_are_read_as_written():
    data = v3_manifest()
    assert parse_manifest(json.dumps(data)) == {**data, "schema_version": MANIFEST_VERSION}
    assert image_problem(IMAGE) is None and image_problem(None) is None


@pytest.mark.parametrize("size", [0, 1, 2**63])
def test_any_non_negative_size_is_accepted(size: int):
    data = v3_manifest({**IMAGE, "size": size})
    assert parse_manifest(json.dumps(data))["envs"]["emt"]["image"]["size"] == size


IMAGE_PATH = 'envs["emt"].image'

# id -> (the image, the JSON path the refusal names)
BAD_IMAGES: dict[str, tuple[Any, str]] = {
    "a string": (".rootstock-image.sqfs", IMAGE_PATH),
    "a list": ([IMAGE], IMAGE_PATH),
    "a number": (5, IMAGE_PATH),
    "sha256 upper-case": ({**IMAGE, "sha256": "3F6C" * 16}, f"{IMAGE_PATH}.sha256"),
    "sha256 short": ({**IMAGE, "sha256": "3f6c"}, f"{IMAGE_PATH}.sha256"),
    "sha256 prefixed": ({**IMAGE, "sha256": "sha256:" + "3f6c" * 16}, f"{IMAGE_PATH}.sha256"),
    "sha256 not hex": ({**IMAGE, "sha256": "zz" * 32}, f"{IMAGE_PATH}.sha256"),
    "sha256 a number": ({**IMAGE, "sha256": 5}, f"{IMAGE_PATH}.sha256"),
    "size negative": ({**IMAGE, "size": -1}, f"{IMAGE_PATH}.size"),
    "size true": ({**IMAGE, "size": True}, f"{IMAGE_PATH}.size"),
    "size a float": ({**IMAGE, "size": 4096.0}, f"{IMAGE_PATH}.size"),
    "size text": ({**IMAGE, "size": "4096"}, f"{IMAGE_PATH}.size"),
    "size null": ({**IMAGE, "size": None}, f"{IMAGE_PATH}.size"),
    "file with a /": ({**IMAGE, "file": "../x.sqfs"}, f"{IMAGE_PATH}.file"),
    "file absolute": ({**IMAGE, "file": "/tmp/x.sqfs"}, f"{IMAGE_PATH}.file"),
    "file a sub-path": ({**IMAGE, "file": "sub/x.sqfs"}, f"{IMAGE_PATH}.file"),
    "file .": ({**IMAGE, "file": "."}, f"{IMAGE_PATH}.file"),
    "file ..": ({**IMAGE, "file": ".."}, f"{IMAGE_PATH}.file"),
    "file empty": ({**IMAGE, "file": ""}, f"{IMAGE_PATH}.file"),
    "file NUL": ({**IMAGE, "file": "x\u0000.sqfs"}, f"{IMAGE_PATH}.file"),
    "compression empty": ({**IMAGE, "compression": ""}, f"{IMAGE_PATH}.compression"),
    "compression a number": ({**IMAGE, "compression": 3}, f"{IMAGE_PATH}.compression"),
    "file missing": ({k: v for k, v in IMAGE.items() if k != "file"}, f"{IMAGE_PATH}.file"),
    "sha256 missing": (
        {k: v for k, v in IMAGE.items() if k != "sha256"},
        f"{IMAGE_PATH}.sha256",
    ),
    "empty object": ({}, f"{IMAGE_PATH}.file"),
    "1e999 under an unknown key": (
        {**IMAGE, "future": [float("inf")]},
        f"{IMAGE_PATH}.future",
    ),
}


@pytest.mark.parametrize(("image", "where"), BAD_IMAGES.values(), ids=BAD_IMAGES.keys())
def test_a_bad_image_is_refused_naming_its_path(
    layout: InstallLayout, image: Any, where: str
) -> None:
    # json.dumps writes inf as Infinity; 1e999 is what overflows in a real file.
    content = json.dumps(v3_manifest(image)).replace("Infinity", "1e999").encode()
    layout.manifest_file.write_bytes(content)
    with pytest.raises(ManifestError) as info:
        load_manifest(layout)
    assert f"is corrupt: {where}: " in info.value.message
    assert layout.manifest_file.read_bytes() == content
    # A writer is refused the same image before it takes the lock.
    assert image_problem(image)


def test_the_refusal_says_what_an_image_must_be():
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(v3_manifest({**IMAGE, "size": True})))
    assert 'envs["emt"].image.size: must be a non-negative integer (bytes), not true' in str(
        info.value
    )
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(v3_manifest("x.sqfs")))
    assert "must be an object {file, sha256, size, compression} or null" in str(info.value)


def test_unknown_image_keys_are_read_but_never_written():
    # As at every level, a reader tolerates a key a later rootstock may add...
    data = v3_manifest({**IMAGE, "block_size": 131072})
    assert parse_manifest(json.dumps(data)) == {**data, "schema_version": MANIFEST_VERSION}
    # ...but a writer of this version may only hand in the four it knows.
    assert image_problem({**IMAGE, "block_size": 131072}) == "unknown keys ['block_size']"


def test_staged_must_be_text_or_null_on_read():
    data = v3_manifest()
    record = data["envs"]["emt"]["checkpoints"]["emt-a"]["verifications"]["alpha"]["gpu"]
    record["staged"] = 5
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(data))
    path = 'envs["emt"].checkpoints["emt-a"].verifications["alpha"]["gpu"].staged'
    assert f'{path}: must be one of "mount", "copy" or null, not 5' in str(info.value)
    # Text a later rootstock may write is read (this one writes only mount or copy).
    record["staged"] = "prefetch"
    assert parse_manifest(json.dumps(data)) == {**data, "schema_version": MANIFEST_VERSION}


# --- the writers --------------------------------------------------------------------------


def test_record_env_build_stores_the_image(layout: InstallLayout):
    given = copy.deepcopy(IMAGE)
    returned = record_env_build(layout, "emt", {"source_hash": "sha256:9b", "image": given})
    assert returned["image"] == IMAGE
    given["size"] = 1  # the caller's dict is not the record
    returned["image"]["size"] = 2
    on_disk = json.loads(layout.manifest_file.read_text())
    assert on_disk["schema_version"] == MANIFEST_VERSION
    assert on_disk["envs"]["emt"]["image"] == IMAGE
    assert load_manifest(layout)["envs"]["emt"]["image"] == IMAGE


def test_a_rebuild_without_an_image_records_none(layout: InstallLayout):
    record_env_build(layout, "emt", {"source_hash": "sha256:9b", "image": IMAGE})
    assert record_env_build(layout, "emt", {"source_hash": "sha256:9c"})["image"] is None
    assert load_manifest(layout)["envs"]["emt"]["image"] is None


@pytest.mark.parametrize(
    "image",
    [{**IMAGE, "sha256": "nope"}, {**IMAGE, "file": "a/b"}, {**IMAGE, "extra": 1}, "x.sqfs"],
    ids=["bad sha256", "file with /", "unknown key", "not an object"],
)
def test_record_env_build_refuses_a_bad_image_before_writing(layout: InstallLayout, image: Any):
    with pytest.raises(ValueError, match=r"build_info\['image'\]"):
        record_env_build(layout, "emt", {"source_hash": "sha256:9b", "image": image})
    assert not layout.manifest_file.exists()


def test_record_verification_stores_staged(layout: InstallLayout):
    passed = {"passed": True, "device": "cpu", "fingerprint": FP}
    assert record_verification(layout, "emt", "a", "alpha", passed)["staged"] is None
    mount = record_verification(layout, "emt", "a", "alpha", {**passed, "staged": "mount"})
    assert mount["staged"] == "mount"
    stored = load_manifest(layout)["envs"]["emt"]["checkpoints"]["a"]["verifications"]
    assert stored["alpha"]["cpu"]["staged"] == "mount"
    copied = record_verification(
        layout, "emt", "a", "alpha", {"passed": False, "device": "cuda:0", "staged": "copy"}
    )
    assert copied["staged"] == "copy"


@pytest.mark.parametrize("staged", ["bogus", "", "MOUNT", 1, True])
def test_record_verification_refuses_another_staged(layout: InstallLayout, staged: Any):
    result = {"passed": True, "device": "cpu", "fingerprint": FP, "staged": staged}
    with pytest.raises(ValueError, match=r"result\['staged'\]"):
        record_verification(layout, "emt", "a", "alpha", result)
    assert not layout.manifest_file.exists()


# --- the dashboard ------------------------------------------------------------------------


@pytest.fixture
def sessions(tmp_path: Path):
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("pydantic")
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    from rootstock.dashboard.models import Base

    engine = create_engine(f"sqlite:///{tmp_path / 'dash.sqlite3'}")
    Base.metadata.create_all(engine)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


def push_as_the_api_does(sessions, cluster: str, body: dict[str, Any]) -> dict[str, Any]:
    """Validate ``body`` as ``PUT .../manifest`` does, store it, and read it back."""
    from sqlalchemy import select

    from rootstock.dashboard import views
    from rootstock.dashboard.ingest import store_push
    from rootstock.dashboard.models import Cluster
    from rootstock.dashboard.schemas import MANIFEST_ADAPTER

    text = json.dumps(body)
    manifest = MANIFEST_ADAPTER.validate_json(text)
    with sessions() as session:
        found = session.execute(select(Cluster).where(Cluster.name == cluster)).scalar()
        if found is None:
            found = Cluster(name=cluster)
            session.add(found)
            session.flush()
        store_push(session, found, manifest, None, body=text)
        session.commit()
        return views.latest_manifest(session, cluster)


def test_the_dashboard_stores_a_v3_push_with_its_image_and_staged(sessions):
    from rootstock.dashboard import views

    body = v3_manifest()
    latest = push_as_the_api_does(sessions, "alpha", body)
    assert latest["manifest"] == body
    with sessions() as session:
        matrix = views.coverage(session)
    [row] = [r for r in matrix["checkpoints"] if r["checkpoint"] == "emt-a"]
    assert row["cells"]["alpha"]["state"] == "verified"


def test_the_dashboard_still_stores_a_v2_push(sessions):
    body = v2_manifest()
    assert push_as_the_api_does(sessions, "alpha", body)["manifest"] == body


def test_the_dashboard_refuses_a_v3_push_whose_image_has_the_wrong_types(sessions):
    from pydantic import ValidationError

    from rootstock.dashboard.schemas import MANIFEST_ADAPTER

    for image in ({**IMAGE, "size": "4096"}, {**IMAGE, "size": True}, "x.sqfs"):
        with pytest.raises(ValidationError) as caught:
            MANIFEST_ADAPTER.validate_python(v3_manifest(image))
        assert all(error["loc"][:3] == ("envs", "emt", "image") for error in caught.value.errors())
