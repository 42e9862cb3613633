"""The manifest's TypedDicts say what the validator and the writers actually do.

Each key a type calls required is one the reader refuses to miss, each key it calls
optional one the reader accepts absent; the field lists the validator and writers
iterate name the same keys; what ``record_*`` returns has the declared keys; and
the core (``install/``) imports no pydantic.
"""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path
from typing import Any, get_args

import pytest

from rootstock.errors import ManifestError
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    ENV_BUILD_FIELDS,
    MANIFEST_VERSION,
    parse_manifest,
    record_env_build,
    record_fetch,
    record_verification,
    types,
    validate,
)
from rootstock.install.manifest.schema import BUILD_REF_FIELDS

SRC = Path(__file__).resolve().parents[2] / "src" / "rootstock"
T0 = "2025-03-01T09:00:00+00:00"
BUILD = {"build_id": "b1", "source_hash": "sha256:9b", "built_at": T0, "lock_hash": "sha256:47"}
FINGERPRINT = {
    "energy_per_atom": -3.9,
    "force_norm": 1.2,
    "stress": [0.1, 0.1, 0.1, 0.0, 0.0, 0.0],
    "natoms": 8,
    "device_kind": "gpu",
    "torch": "2.4.0",
    "env_versions": {"mace-torch": "0.3.6"},
}
QUANTITY = {
    "mode": "gradient",
    "ok": True,
    "ratio": 1.0,
    "cosine": 1.0,
    "norm_ratio": 1.0,
    "tol": {"ratio": 0.1, "rule": "float32"},
    "directions": 3,
    "message": None,
}
REFERENCE = {"fingerprint": FINGERPRINT, "at": T0, "build": BUILD, "kwargs": {}}
WEIGHT = {"size": 11, "sha256": "9b" * 32, "mtime": 1741400000.25}
IMAGE = {"file": ".rootstock-image.sqfs", "sha256": "ab" * 32, "size": 4096, "compression": "lz4"}


def full_manifest() -> dict[str, Any]:
    """A manifest with every field each record type declares."""
    record = {
        "state": "verified",
        "at": T0,
        "device": "cuda:0",
        "device_kind": "gpu",
        "staged": "mount",
        "message": None,
        "kwargs": {},
        "fingerprint": FINGERPRINT,
        "reference": REFERENCE,
        "references": {"{}": REFERENCE},
        "drift": None,
        "checks": {
            "ok": True,
            "dtype": "float32",
            "model_dtype": "float32",
            "step": 0.01,
            "energy": "smooth",
            "energy_calls": 8,
            "seconds": 0.4,
            "forces": QUANTITY,
            "stress": QUANTITY,
        },
        "build": BUILD,
    }
    env = {
        "build_id": "b1",
        "source_hash": "sha256:9b",
        "lock_hash": "sha256:47",
        "built_at": T0,
        "python": "3.11.9",
        "python_path": "/opt/python3.11",
        "torch": "2.4.0",
        "rootstock": "0.1.0",
        "image": IMAGE,
        "checkpoints": {
            "m": {
                "fetched_at": T0,
                "files": ["home/.cache/mace/m.model"],
                "weights": {"home/.cache/mace/m.model": WEIGHT},
                "verifications": {"alpha": {"gpu": record}},
            }
        },
    }
    return copy.deepcopy(
        {
            "schema_version": MANIFEST_VERSION,
            "clusters": ["alpha"],
            "created_at": T0,
            "updated_at": T0,
            "written_by": "rootstock 0.1.0",
            "envs": {"mace": env},
        }
    )


def _record(data: dict[str, Any]) -> dict[str, Any]:
    return data["envs"]["mace"]["checkpoints"]["m"]["verifications"]["alpha"]["gpu"]


# Where each record type sits in full_manifest().
PLACES = {
    types.Manifest: lambda d: d,
    types.EnvRecord: lambda d: d["envs"]["mace"],
    types.ImageRecord: lambda d: d["envs"]["mace"]["image"],
    types.CheckpointRecord: lambda d: d["envs"]["mace"]["checkpoints"]["m"],
    types.WeightFile: lambda d: d["envs"]["mace"]["checkpoints"]["m"]["weights"][
        "home/.cache/mace/m.model"
    ],
    types.Verification: _record,
    types.Reference: lambda d: _record(d)["reference"],
    types.Fingerprint: lambda d: _record(d)["fingerprint"],
    types.BuildRef: lambda d: _record(d)["build"],
}


def keys_of(record: type) -> set[str]:
    return set(record.__required_keys__ | record.__optional_keys__)


def _parses(data: dict[str, Any]) -> bool:
    try:
        parse_manifest(json.dumps(data))
    except ManifestError:
        return False
    return True


def test_the_full_manifest_parses_and_uses_every_declared_key():
    data = full_manifest()
    assert _parses(data)
    for record, place in PLACES.items():
        assert set(place(data)) == keys_of(record), record.__name__
    checks = _record(data)["checks"]
    assert set(checks) == keys_of(types.Checks)
    assert set(checks["forces"]) == keys_of(types.QuantityCheck)


@pytest.mark.parametrize("record", list(PLACES), ids=lambda r: r.__name__)
def test_required_keys_are_the_ones_the_reader_refuses_to_miss(record):
    for key in sorted(keys_of(record)):
        data = full_manifest()
        del PLACES[record](data)[key]
        if (record, key) == (types.Manifest, "schema_version"):
            # Absent means the unversioned draft (version 0): migrated, and the
            # manifest read back has it again.
            assert parse_manifest(json.dumps(data))["schema_version"] == MANIFEST_VERSION
            continue
        required = key in record.__required_keys__
        assert _parses(data) is not required, f"{record.__name__}.{key}"


def test_the_field_lists_name_the_declared_keys():
    assert (*ENV_BUILD_FIELDS, "checkpoints") == tuple(types.EnvRecord.__annotations__)
    assert tuple(types.BuildRef.__annotations__) == BUILD_REF_FIELDS
    walked = {
        types.Manifest: validate._TOP_KEYS,
        types.EnvRecord: validate._ENV_KEYS,
        types.ImageRecord: validate._IMAGE_KEYS,
        types.CheckpointRecord: validate._CHECKPOINT_KEYS,
        types.WeightFile: validate._WEIGHT_KEYS,
        types.Verification: validate._RECORD_KEYS,
        types.Reference: validate._REFERENCE_KEYS,
        types.BuildRef: validate._BUILD_KEYS,
        types.Fingerprint: validate._FINGERPRINT_KEYS,
    }
    for record, known in walked.items():
        assert set(known) == keys_of(record), record.__name__
    assert set(get_args(types.VerificationState)) == set(validate.VERIFICATION_STATES)


def test_records_written_have_the_declared_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    layout = InstallLayout(tmp_path, tmp_path)
    env = record_env_build(layout, "mace", {"source_hash": "sha256:9b", "python": "3.11.9"})
    assert tuple(env) == ENV_BUILD_FIELDS
    assert env["python"] == "3.11.9" and env["build_id"] and env["built_at"]
    # Without files a record is unattributed: it has every key but ``files`` and
    # ``weights`` (the weights are those of listed files).
    unattributed = keys_of(types.CheckpointRecord) - {"files", "weights"}
    assert set(record_fetch(layout, "mace", "m")) == unattributed
    fetched = record_fetch(layout, "mace", "m", files=["a.bin"], weights={"a.bin": WEIGHT})
    assert set(fetched) == keys_of(types.CheckpointRecord)
    result = {"passed": True, "device": "cpu", "fingerprint": FINGERPRINT, "checks": None}
    record = record_verification(layout, "mace", "m", "alpha", result)
    assert set(record) == keys_of(types.Verification)
    assert set(record["reference"]) == keys_of(types.Reference)
    assert set(record["build"]) == keys_of(types.BuildRef)


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_core_imports_no_pydantic():
    files = sorted((SRC / "install").rglob("*.py"))
    assert files
    for path in files:
        leaked = _imported_modules(path) & {"pydantic", "typing_extensions", "fastapi"}
        assert not leaked, f"{path.relative_to(SRC)} imports {sorted(leaked)}"
