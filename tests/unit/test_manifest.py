"""The manifest store: round trips, migrations, refusals, clusters, locking (in-process)."""

from __future__ import annotations

import errno
import fcntl
import json
import threading
from pathlib import Path

import pytest

from rootstock.errors import LockTimeout, ManifestError, UsageError
from rootstock.install.layout import InstallLayout
from rootstock.install.locking import FileLock
from rootstock.install.machine import resolve_cluster, served_clusters
from rootstock.install.manifest import (
    MANIFEST_VERSION,
    ensure_manifest,
    forget_env,
    load_manifest,
    manifest_lock_path,
    migrations,
    parse,
    parse_manifest,
    record_env_build,
    record_fetch,
    record_verification,
    update_manifest,
)

FP = {"energy_per_atom": -3.9, "force_norm": 1.2, "stress": [0.1, 0.1, 0.1, 0.0, 0.0, 0.0]}


@pytest.fixture(autouse=True)
def _no_site_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    return InstallLayout(tmp_path, tmp_path)


def build(source_hash: str = "sha256:aaa", built_at: str = "2025-01-01T00:00:00+00:00") -> dict:
    return {
        "source_hash": source_hash,
        "lock_hash": "sha256:lock",
        "built_at": built_at,
        "python": "3.11.9",
        "python_path": "/root/.python/cpython-3.11/bin/python3",
        "torch": "2.4.0",
        "rootstock": "0.1.0",
    }


def test_absent_manifest_loads_fresh_and_is_not_written(layout: InstallLayout) -> None:
    data = load_manifest(layout)
    assert data["schema_version"] == MANIFEST_VERSION
    assert data["clusters"] == [] and data["envs"] == {}
    assert not layout.manifest_file.exists()


def test_round_trip_of_every_record(layout: InstallLayout) -> None:
    record_env_build(layout, "mace", build())
    record_fetch(layout, "mace", "mace-mp-0-small", at="2025-01-02T00:00:00+00:00")
    stored = record_verification(
        layout,
        "mace",
        "mace-mp-0-small",
        "Della",
        {"passed": True, "device": "cuda:0", "fingerprint": FP},
    )
    on_disk = json.loads(layout.manifest_file.read_text())
    assert on_disk == load_manifest(layout)
    assert on_disk["schema_version"] == MANIFEST_VERSION
    assert on_disk["clusters"] == ["della"]
    assert on_disk["written_by"].startswith("rootstock ")
    assert on_disk["updated_at"].endswith("+00:00")
    env = on_disk["envs"]["mace"]
    assert {k: env[k] for k in build()} == build()
    assert len(env["build_id"]) == 16
    ck = env["checkpoints"]["mace-mp-0-small"]
    assert ck["fetched_at"] == "2025-01-02T00:00:00+00:00"
    record = ck["verifications"]["della"]["gpu"]
    assert record == stored
    assert record["state"] == "verified" and record["device"] == "cuda:0"
    assert record["device_kind"] == "gpu"
    assert record["build"] == {
        "build_id": env["build_id"],
        "source_hash": "sha256:aaa",
        "built_at": "2025-01-01T00:00:00+00:00",
        "lock_hash": "sha256:lock",
    }
    assert record["reference"]["fingerprint"] == FP


def test_update_returns_mutate_result_and_skips_unchanged_writes(layout: InstallLayout) -> None:
    assert update_manifest(layout, lambda d: d["clusters"].append("a") or "ok") == "ok"
    before = layout.manifest_file.stat()
    assert update_manifest(layout, lambda d: len(d["clusters"])) == 1
    after = layout.manifest_file.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_failing_mutation_writes_nothing(layout: InstallLayout) -> None:
    record_fetch(layout, "e", "c")
    original = layout.manifest_file.read_bytes()

    def broken(data: dict) -> None:
        data["envs"].clear()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        update_manifest(layout, broken)
    assert layout.manifest_file.read_bytes() == original


def test_rebuild_keeps_checkpoints_and_forget_drops_them(layout: InstallLayout) -> None:
    record_env_build(layout, "mace", build())
    record_fetch(layout, "mace", "small")
    record_env_build(layout, "mace", {"source_hash": "sha256:bbb"})
    env = load_manifest(layout)["envs"]["mace"]
    assert env["source_hash"] == "sha256:bbb" and env["built_at"] and env["torch"] is None
    assert "small" in env["checkpoints"]
    with pytest.raises(ValueError, match="unknown env build fields"):
        record_env_build(layout, "mace", {"source_hash": "x", "torch_version": "2"})
    assert forget_env(layout, "mace") is True
    assert forget_env(layout, "mace") is False
    assert load_manifest(layout)["envs"] == {}


V0 = {
    "cluster": "Della",
    "updated_at": "2024-05-01T00:00:00+00:00",
    "environments": {
        "mace": {
            "source_hash": "sha256:old",
            "built_at": "2024-04-01T00:00:00+00:00",
            "python_version": "3.11",
            "torch_version": "2.2.0",
            "checkpoints": {
                "small": {"verified_at": "2024-04-02T00:00:00+00:00", "device": "cuda"},
                "large": {
                    "fetched": True,
                    "verified_at": "2024-04-03T00:00:00+00:00",
                    "device": "cpu",
                    "error": "CUDA OOM\nTraceback...",
                },
                "never": {},
            },
        }
    },
}


def test_v0_manifest_is_migrated_on_read_and_written_on_next_update(
    layout: InstallLayout,
) -> None:
    layout.manifest_file.write_text(json.dumps(V0))
    original = layout.manifest_file.read_bytes()
    data = load_manifest(layout)
    assert layout.manifest_file.read_bytes() == original  # reading never writes
    assert data["schema_version"] == MANIFEST_VERSION and data["clusters"] == ["della"]
    env = data["envs"]["mace"]
    assert (env["python"], env["torch"], env["lock_hash"]) == ("3.11", "2.2.0", None)
    small = env["checkpoints"]["small"]
    assert small["fetched_at"] == "2024-04-02T00:00:00+00:00"
    assert small["verifications"]["della"]["gpu"]["state"] == "verified"
    assert small["verifications"]["della"]["gpu"]["build"]["source_hash"] is None
    large = env["checkpoints"]["large"]["verifications"]["della"]["cpu"]
    assert (large["state"], large["message"]) == ("failed", "CUDA OOM")
    assert env["checkpoints"]["never"] == {"fetched_at": None, "verifications": {}}
    update_manifest(layout, lambda d: None)
    assert json.loads(layout.manifest_file.read_text())["schema_version"] == MANIFEST_VERSION


def test_migrations_chain_through_every_registered_step(
    layout: InstallLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    def v1_to_v2(data: dict) -> dict:
        return {**data, "schema_version": 2, "added_in_v2": True}

    monkeypatch.setattr(parse, "MANIFEST_VERSION", 2)  # the version parsing migrates to
    monkeypatch.setitem(migrations.MIGRATIONS, 1, v1_to_v2)
    data = parse_manifest(json.dumps(V0))
    assert data["schema_version"] == 2 and data["added_in_v2"] is True
    assert data["clusters"] == ["della"]


def test_a_migration_that_misses_its_target_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(migrations.MIGRATIONS, 0, lambda data: data)
    with pytest.raises(ManifestError, match="could not be migrated"):
        parse_manifest("{}")


CORRUPT = {
    "truncated": b'{"schema_version": 1, "clusters": [',
    "empty": b"",
    "not utf-8": b"\xff\xfe\x00{",
    "array": b"[1, 2, 3]",
    "string": b'"manifest"',
    "bad version": b'{"schema_version": "one", "clusters": [], "envs": {}}',
    "bad clusters": b'{"schema_version": 1, "clusters": "della", "envs": {}}',
    "bad env": b'{"schema_version": 1, "clusters": [], "envs": {"mace": 3}}',
    "bad record": b'{"schema_version": 1, "clusters": [], "envs": {"m": {"checkpoints":'
    b' {"c": {"verifications": {"della": {"cpu": 1}}}}}}}',
}


def every_writer(layout: InstallLayout) -> list:
    return [
        lambda: load_manifest(layout),
        lambda: update_manifest(layout, lambda d: d["clusters"].append("x")),
        lambda: ensure_manifest(layout, ["della"]),
        lambda: record_env_build(layout, "e", {"source_hash": "h"}),
        lambda: record_fetch(layout, "e", "c"),
        lambda: record_verification(layout, "e", "c", "della", {"passed": False}),
        lambda: forget_env(layout, "e"),
        lambda: served_clusters(layout),
    ]


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
def test_corrupt_manifest_is_refused_and_left_byte_for_byte(
    layout: InstallLayout, content: bytes
) -> None:
    layout.manifest_file.write_bytes(content)
    for call in every_writer(layout):
        with pytest.raises(ManifestError) as info:
            call()
        assert "is corrupt" in info.value.message
        assert "left untouched" in (info.value.hint or "")
        assert layout.manifest_file.read_bytes() == content


def test_newer_schema_is_refused_and_left_byte_for_byte(layout: InstallLayout) -> None:
    content = b'{"schema_version": 99, "clusters": [], "envs": {}, "future": true}\n'
    layout.manifest_file.write_bytes(content)
    for call in every_writer(layout):
        with pytest.raises(ManifestError) as info:
            call()
        assert "schema version 99" in info.value.message
        assert "upgrade rootstock" in (info.value.hint or "")
        assert layout.manifest_file.read_bytes() == content


def test_init_creates_merges_and_force_keeps_a_backup(layout: InstallLayout) -> None:
    first = ensure_manifest(layout, ["Sophia"])
    assert first.created and first.clusters == ["sophia"]
    record_fetch(layout, "mace", "small")
    again = ensure_manifest(layout, ["polaris", "sophia"])
    assert not again.created and again.clusters == ["sophia", "polaris"]
    assert "small" in load_manifest(layout)["envs"]["mace"]["checkpoints"]
    layout.manifest_file.write_bytes(b"{broken")
    with pytest.raises(ManifestError):
        ensure_manifest(layout, ["sophia"])
    forced = ensure_manifest(layout, ["sophia"], force=True)
    assert forced.created and forced.backup is not None
    assert forced.backup.read_bytes() == b"{broken"
    assert forced.to_dict()["backup"] == str(forced.backup)
    assert load_manifest(layout)["envs"] == {}
    assert load_manifest(layout)["clusters"] == ["sophia"]


def test_registry_siblings_are_served(
    layout: InstallLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = tmp_path / "clusters.toml"
    registry.write_text(
        f'[clusters.sophia]\nroot = "{layout.root}"\n[clusters.polaris]\nroot = "{layout.root}"\n'
    )
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(registry))
    assert served_clusters(layout) == ["polaris", "sophia"]
    assert ensure_manifest(layout, ["sophia"]).clusters == ["sophia", "polaris"]


def test_resolve_cluster(layout: InstallLayout) -> None:
    with pytest.raises(UsageError, match="names no cluster"):
        resolve_cluster(layout, None)
    assert resolve_cluster(layout, "Anywhere") == "anywhere"  # nothing to check against yet
    ensure_manifest(layout, ["della"])
    assert resolve_cluster(layout, None) == "della"
    ensure_manifest(layout, ["stellar"])
    with pytest.raises(UsageError, match="several clusters"):
        resolve_cluster(layout, None)
    with pytest.raises(UsageError, match="does not serve") as info:
        resolve_cluster(layout, "delta")
    assert "manifest init --cluster delta" in (info.value.hint or "")
    assert resolve_cluster(layout, "STELLAR") == "stellar"


def test_lock_file_lives_under_the_locks_dir(layout: InstallLayout) -> None:
    record_fetch(layout, "e", "c")
    assert manifest_lock_path(layout) == layout.root / ".locks" / "manifest.lock"
    assert manifest_lock_path(layout).exists()


def test_lock_timeout_is_a_clear_error(layout: InstallLayout) -> None:
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with FileLock(manifest_lock_path(layout)):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        with pytest.raises(LockTimeout, match="manifest lock"):
            record_fetch(layout, "e", "c", timeout=0.2)
    finally:
        release.set()
        thread.join(10)
    record_fetch(layout, "e", "c", timeout=5)


def test_mkdir_fallback_when_fcntl_refuses_locks(
    layout: InstallLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", refuse)
    lock_dir = layout.locks_dir / "manifest.lock.d"
    seen = update_manifest(layout, lambda d: lock_dir.is_dir())
    assert seen is True  # the write ran inside the mkdir lock
    assert not lock_dir.exists()  # and released it


def test_old_temp_files_of_killed_writers_are_swept(layout: InstallLayout) -> None:
    import os
    import time

    record_fetch(layout, "e", "c")
    orphan = layout.root / ".manifest.json.tmp-99999-deadbeef"
    fresh = layout.root / ".manifest.json.tmp-99998-cafef00d"
    orphan.write_text("{")
    fresh.write_text("{")
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    record_fetch(layout, "e", "d")
    assert not orphan.exists()
    assert fresh.exists()  # young enough to belong to a live writer
