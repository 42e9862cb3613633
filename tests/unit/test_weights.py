"""Weight files: hashed at ``add``, re-checked before verification, and the manifest's
``weights`` and ``tampered`` (schema 4), all in-process (no worker, no uv).

The end-to-end behaviour (a flipped byte, ``smoke-test --rehash``, a worker start)
is in tests/integration/test_weight_integrity.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from rootstock.errors import ManifestError
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    MANIFEST_VERSION,
    checkpoint_state,
    load_manifest,
    parse_manifest,
    record_fetch,
    record_verification,
    record_weights,
)
from rootstock.install.weights import (
    check_weights,
    clear_reverification_mark,
    describe_change,
    hash_file,
    human_size,
    marked_for_reverification,
    weigh_files,
)
from rootstock.ops.integrity import recheck_weights
from rootstock.ops.sync_plan import WEIGHTS_CHANGED, SyncOptions, plan_sync
from rootstock.runtime.weights_watch import check_weights_at_start
from tests.unit.test_sync_plan import built, env_file, manifest, state_of, steps, verified_entry

pytestmark = pytest.mark.timeout(120)

T0 = "2025-03-08T02:14:51+00:00"
FINGERPRINT = {"energy_per_atom": -3.9, "force_norm": 1.2, "stress": None}


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> InstallLayout:
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    root = tmp_path / "root"
    (root / ".locks").mkdir(parents=True)
    return InstallLayout(root, root)


def put(layout: InstallLayout, relative: str, data: bytes) -> Path:
    path = layout.cache_root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def flip_keeping_stat(path: Path) -> None:
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


# --- hashing and checking ----------------------------------------------------------------


def test_hash_file_reads_every_chunk(tmp_path: Path):
    path = tmp_path / "w.bin"
    data = os.urandom(3 * (1 << 20) + 17)  # three whole chunks and a partial one
    path.write_bytes(data)
    entry = hash_file(path)
    assert entry == {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "mtime": os.stat(path).st_mtime,
    }


def test_weigh_files_hashes_weight_files_only(layout: InstallLayout):
    put(layout, "cache/m/model.pt", b"weights")
    put(layout, "cache/m/empty", b"")
    put(layout, "cache/.locks/m.lock", b"lock")
    os.symlink("model.pt", layout.cache_root / "cache/m/link")
    files = ["cache/.locks/m.lock", "cache/m/empty", "cache/m/gone", "cache/m/link"]
    weights, gone = weigh_files(layout.cache_root, [*files, "cache/m/model.pt"])
    assert list(weights) == ["cache/m/model.pt"]
    assert weights["cache/m/model.pt"]["sha256"] == hashlib.sha256(b"weights").hexdigest()
    assert gone == ["cache/m/gone"]


def test_check_is_a_stat_by_default_and_a_hash_with_rehash(layout: InstallLayout):
    path = put(layout, "cache/m/model.pt", b"the weights")
    recorded, _ = weigh_files(layout.cache_root, ["cache/m/model.pt"])
    assert check_weights(layout.cache_root, recorded).hashed == 0
    flip_keeping_stat(path)
    quiet = check_weights(layout.cache_root, recorded)
    assert quiet.ok and quiet.hashed == 0  # size and mtime as recorded: not read
    loud = check_weights(layout.cache_root, recorded, rehash=True)
    (change,) = loud.changed
    assert change.path == "cache/m/model.pt" and change.size == len(b"the weights")
    assert change.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert change.sha256 != recorded["cache/m/model.pt"]["sha256"]


def test_a_size_change_is_caught_without_rehash(layout: InstallLayout):
    path = put(layout, "cache/m/model.pt", b"the weights")
    recorded, _ = weigh_files(layout.cache_root, ["cache/m/model.pt"])
    path.write_bytes(b"the weights!")
    (change,) = check_weights(layout.cache_root, recorded).changed
    assert change.size == 12 and change.recorded["size"] == 11


def test_a_touched_file_with_the_same_bytes_is_refreshed_not_changed(layout: InstallLayout):
    path = put(layout, "cache/m/model.pt", b"the weights")
    recorded, _ = weigh_files(layout.cache_root, ["cache/m/model.pt"])
    os.utime(path, (1_700_000_000, 1_700_000_000))
    check = check_weights(layout.cache_root, recorded)
    assert check.ok and check.hashed == 1
    assert check.refreshed["cache/m/model.pt"]["mtime"] == 1_700_000_000.0


def test_a_missing_file_is_a_change(layout: InstallLayout):
    path = put(layout, "cache/m/model.pt", b"w")
    recorded, _ = weigh_files(layout.cache_root, ["cache/m/model.pt"])
    path.unlink()
    (change,) = check_weights(layout.cache_root, recorded).changed
    assert change.size is None and change.sha256 is None


def test_the_message_names_the_file_both_hashes_and_sizes(layout: InstallLayout):
    path = put(layout, "cache/mace/m.model", b"a" * 11_000_000)
    recorded, _ = weigh_files(layout.cache_root, ["cache/mace/m.model"])
    flip_keeping_stat(path)
    changes = check_weights(layout.cache_root, recorded, rehash=True).changed
    old, new = recorded["cache/mace/m.model"]["sha256"], changes[0].sha256
    assert new is not None
    assert describe_change("mace-mp-0-medium", changes) == (
        f"weights of mace-mp-0-medium changed since add: cache/mace/m.model "
        f"sha256 {old[:16]}… ≠ {new[:16]}… (size 11 MB → 11 MB); "
        "re-run rootstock add mace-mp-0-medium to accept the new file"
    )
    assert human_size(512) == "512 B" and human_size(1_234_000_000) == "1.2 GB"


# --- the manifest: weights, tampered, schema 4 --------------------------------------------

WEIGHT = {"size": 11, "sha256": "9b" * 32, "mtime": 1741400000.5}


def v4(weights: Any = None, state: str = "verified") -> dict[str, Any]:
    entry: dict[str, Any] = {
        "fetched_at": T0,
        "files": ["cache/m.pt"],
        "verifications": {"alpha": {"cpu": {"state": state, "at": T0, "device": "cpu"}}},
    }
    if weights is not None:
        entry["weights"] = weights
    return {
        "schema_version": MANIFEST_VERSION,
        "clusters": ["alpha"],
        "envs": {"emt": {"checkpoints": {"m": entry}}},
    }


def test_weights_and_tampered_are_read_as_written_and_weights_may_be_absent():
    for data in (v4({"cache/m.pt": WEIGHT}, "tampered"), v4()):
        assert parse_manifest(json.dumps(data)) == data


WHERE = 'envs["emt"].checkpoints["m"].weights'


@pytest.mark.parametrize(
    ("weights", "problem"),
    [
        ([], f"{WHERE}: must be an object of weight files, not a list"),
        ({"/abs": WEIGHT}, f'{WHERE}["/abs"]: must be relative to the cache root'),
        ({"a/../b": WEIGHT}, f'{WHERE}["a/../b"]: must be a clean relative path'),
        ({"m.pt": 5}, f'{WHERE}["m.pt"]: must be an object {{size, sha256, mtime}}, not 5'),
        ({"m.pt": {**WEIGHT, "size": -1}}, f'{WHERE}["m.pt"].size: must be a non-negative'),
        ({"m.pt": {**WEIGHT, "size": True}}, f'{WHERE}["m.pt"].size: must be a non-negative'),
        ({"m.pt": {**WEIGHT, "sha256": "AB" * 32}}, f'{WHERE}["m.pt"].sha256: must be 64'),
        ({"m.pt": {**WEIGHT, "mtime": "now"}}, f'{WHERE}["m.pt"].mtime: must be a finite number'),
        ({"m.pt": {"size": 1, "sha256": "9b" * 32}}, f'{WHERE}["m.pt"].mtime: must be a finite'),
    ],
)
def test_a_bad_weights_record_is_refused_naming_its_path(weights: Any, problem: str):
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(v4(weights)))
    assert problem in str(info.value)


def test_an_unknown_state_is_refused_listing_tampered():
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(v4(state="mangled")))
    assert 'one of "verified", "failed", "drifted", "tampered", not "mangled"' in str(info.value)


def test_a_v3_file_migrates_to_v4_unchanged_but_for_its_version():
    data = v4()
    data["schema_version"] = 3
    migrated = parse_manifest(json.dumps(data))
    assert migrated == {**copy.deepcopy(data), "schema_version": 4}
    # A v3 reader never saw tampered: a v3 file claiming it is refused as v3 was.
    data["envs"]["emt"]["checkpoints"]["m"]["verifications"]["alpha"]["cpu"]["state"] = "x"
    with pytest.raises(ManifestError, match="as migrated from schema version 3"):
        parse_manifest(json.dumps(data))


def test_record_fetch_and_record_weights_keep_only_listed_files(layout: InstallLayout):
    other = {**WEIGHT, "size": 12}
    record_fetch(layout, "emt", "m", files=["a.pt", "b.pt"], weights={"a.pt": WEIGHT})
    # A path the record does not list is ignored; a dropped one loses its entry.
    entry = record_weights(layout, "emt", "m", {"b.pt": other, "zz.pt": WEIGHT}, dropped=["a.pt"])
    assert entry["weights"] == {"b.pt": other}
    assert load_manifest(layout)["envs"]["emt"]["checkpoints"]["m"]["weights"] == {"b.pt": other}
    with pytest.raises(ValueError, match="sha256"):
        record_weights(layout, "emt", "m", {"b.pt": {**WEIGHT, "sha256": "nope"}})
    # An unattributed record (no files) gets no weights.
    assert "weights" not in record_weights(layout, "emt", "n", {"a.pt": WEIGHT})


def test_a_tampered_record_keeps_the_reference_and_shows_as_tampered(layout: InstallLayout):
    build = {"source_hash": "sha256:9b"}
    passed = {"passed": True, "device": "cpu", "fingerprint": FINGERPRINT, "build": build}
    first = record_verification(layout, "emt", "m", "alpha", passed)
    message = "weights of m changed since add: cache/m.pt sha256 …"
    result = {
        "passed": False,
        "tampered": True,
        "device": "cpu",
        "message": message,
        "build": build,
    }
    record = record_verification(layout, "emt", "m", "alpha", result)
    assert record["state"] == "tampered" and record["message"] == message
    assert record["fingerprint"] is None and record["references"] == first["references"]
    shown = checkpoint_state(load_manifest(layout), "emt", "m", "alpha")
    assert shown.state == "tampered" and shown.message == message
    with pytest.raises(ValueError, match="tampered"):
        record_verification(layout, "emt", "m", "alpha", {**passed, "tampered": True})


# --- the re-check before verification, and the worker start's marker ---------------------


def added(layout: InstallLayout, data: bytes = b"the weights") -> Path:
    path = put(layout, "cache/m.pt", data)
    weights, _ = weigh_files(layout.cache_root, ["cache/m.pt"])
    record_fetch(layout, "emt", "m", files=["cache/m.pt"], weights=weights)
    return path


def test_recheck_records_a_refreshed_mtime(layout: InstallLayout):
    path = added(layout)
    os.utime(path, (1_700_000_000, 1_700_000_000))
    assert recheck_weights(layout, "emt", "m").problem is None
    stored = load_manifest(layout)["envs"]["emt"]["checkpoints"]["m"]["weights"]["cache/m.pt"]
    assert stored["mtime"] == 1_700_000_000.0


def test_a_worker_start_marks_and_the_mark_forces_a_full_rehash(layout: InstallLayout):
    path = added(layout)
    recorded = os.stat(path)
    flip_keeping_stat(path)
    os.utime(path, (recorded.st_atime + 5, recorded.st_mtime + 5))
    manifest_bytes = layout.manifest_file.read_bytes()
    assert check_weights_at_start(layout, "emt", "m") == ["cache/m.pt"]
    assert layout.manifest_file.read_bytes() == manifest_bytes  # never the manifest
    assert marked_for_reverification(layout, "emt", "m")
    # Stat matches again; only the marker makes the default re-check read the bytes.
    os.utime(path, ns=(recorded.st_atime_ns, recorded.st_mtime_ns))
    recheck = recheck_weights(layout, "emt", "m")
    assert recheck.rehashed and recheck.problem is not None
    assert recheck.problem.startswith("weights of m changed since add: cache/m.pt sha256 ")
    assert not marked_for_reverification(layout, "emt", "m")  # cleared
    # Without the marker, the same file passes a default re-check: a stat.
    assert recheck_weights(layout, "emt", "m").problem is None


def test_a_foreign_or_torn_marker_counts_as_none(layout: InstallLayout):
    marker = layout.reverify_marker("emt", "m")
    marker.parent.mkdir()
    marker.write_text('{"env": "other", "checkpoint": "m"}')
    assert not marked_for_reverification(layout, "emt", "m")
    marker.write_text('{"env": "emt", "check')
    assert not marked_for_reverification(layout, "emt", "m")
    clear_reverification_mark(layout, "emt", "m")
    clear_reverification_mark(layout, "emt", "m")  # twice: no error
    assert not marker.exists()


def test_a_worker_start_never_raises(layout: InstallLayout):
    layout.manifest_file.write_text("{not json")
    assert check_weights_at_start(layout, "emt", "m") == []
    layout.manifest_file.unlink()
    added(layout).write_bytes(b"grown weights")
    layout.reverify_dir.write_text("a file where the directory goes")
    assert check_weights_at_start(layout, "emt", "m") == ["cache/m.pt"]


# --- sync plans a verify for changed weights, and re-verifies a tampered one -----------


def test_sync_plans_a_verify_for_changed_weights_and_a_tampered_checkpoint():
    emt = env_file("emt", ["a", "b", "c"])
    data = manifest(
        (
            emt,
            {
                "a": verified_entry(emt),
                "b": verified_entry(emt, "tampered"),
                "c": verified_entry(emt),
            },
        )
    )
    state = state_of(data, built(emt))
    assert steps(plan_sync(state, [emt], SyncOptions())) == [
        ("verify", "emt/b", "tampered last time: synthetic tampered")
    ]
    changed = type(state)(**{**state.__dict__, "weights_changed": frozenset({("emt", "a")})})
    assert steps(plan_sync(changed, [emt], SyncOptions())) == [
        ("verify", "emt/a", WEIGHTS_CHANGED),
        ("verify", "emt/b", "tampered last time: synthetic tampered"),
    ]


def test_sync_reads_only_the_weights_in_its_scope(layout: InstallLayout):
    from rootstock.ops.sync import read_install_state

    for env_name in ("emt", "other"):
        path = put(layout, f"cache/{env_name}.pt", b"the weights")
        weights, _ = weigh_files(layout.cache_root, [f"cache/{env_name}.pt"])
        record_fetch(layout, env_name, "m", files=[f"cache/{env_name}.pt"], weights=weights)
        flip_keeping_stat(path)  # only a full re-hash sees it

    def changed(scope: SyncOptions | None, rehash: bool = True) -> frozenset:
        state = read_install_state(
            layout, "alpha", "cpu", verifying=True, rehash=rehash, scope=scope
        )
        return state.weights_changed

    assert changed(None) == {("emt", "m"), ("other", "m")}
    assert changed(SyncOptions(envs=frozenset({"emt"}))) == {("emt", "m")}
    assert changed(SyncOptions(checkpoints=frozenset({"n"}))) == frozenset()
    assert changed(None, rehash=False) == frozenset()  # size and mtime kept: a stat passes
