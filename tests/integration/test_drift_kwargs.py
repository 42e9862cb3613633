"""Drift compares like with like: reference fingerprints are filed by setup kwargs.

A pass with ``add --kwarg`` and a smoke-test with ``VERIFY_KWARGS`` run different
models (``modal=R2SCAN`` against the default head), so neither may be judged against
the other's reference. The first test drives the real CLI, real uv and a real
worker; the second feeds a schema-1 manifest through the migration in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import MANIFEST_VERSION, load_manifest, record_verification
from tests.conftest import run_rootstock
from tests.integration.checkpoint_envs import (
    hotfix,
    install,
    manifest_record,
    set_scale,
    smoke_json,
    write_env,
)

pytestmark = pytest.mark.timeout(600)

# setup() multiplies EMT by SCALE (the env's literal, which a hotfix edits) and by
# the `scale` kwarg: a different kwarg is a different model, as modal= is for MACE.
KWARG_SCALED_SETUP = '''

def setup(checkpoint, device="cuda", scale=1.0, **kw):
    """EMT scaled by SCALE times the ``scale`` setup kwarg."""
    return scaled_emt(SCALE * scale)
'''


def kwargs_key(kwargs: dict) -> str:
    """The documented ``references`` key: the kwargs as compact, key-sorted JSON."""
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"))


def add_json(root: Path, *args: str) -> dict:
    """``add ARGS --json --device cpu --root ROOT`` as a dict."""
    proc = run_rootstock("add", *args, "--device", "cpu", "--json", "--root", root, timeout=300)
    return json.loads(proc.stdout)


def test_kwargs_passes_keep_their_own_reference(scratch_root: Path, tmp_path: Path):
    root = scratch_root
    tables = 'VERIFY_KWARGS = {"kw-emt": {"scale": 1.0}}\n'
    install(root, write_env(tmp_path / "src", "kwdrift", ["kw-emt"], tables=tables,
                            body=KWARG_SCALED_SETUP))  # fmt: skip

    # 0.1 % apart: far beyond the drift tolerance if the two were ever compared.
    first = add_json(root, "kw-emt", "--kwarg", "scale=1.001")
    assert first["state"] == "verified" and first["kwargs"] == {"scale": 1.001}
    scaled_reference = manifest_record(root, "kwdrift", "kw-emt")["reference"]

    # The issue: smoke-test (VERIFY_KWARGS, scale=1.0) was judged against scale=1.001.
    code, summary = smoke_json(root)
    assert (code, summary["counts"]) == (0, {"verified": 1}), summary
    assert scaled_reference["kwargs"] == {"scale": 1.001}
    record = manifest_record(root, "kwdrift", "kw-emt")
    assert record["kwargs"] == {"scale": 1.0}
    assert record["reference"]["kwargs"] == {"scale": 1.0}
    assert set(record["references"]) == {kwargs_key({"scale": 1.0}), kwargs_key({"scale": 1.001})}

    again = add_json(root, "kw-emt", "--kwarg", "scale=1.001")
    assert again["state"] == "verified", again
    by_kwargs = manifest_record(root, "kwdrift", "kw-emt")["references"]
    assert by_kwargs[kwargs_key({"scale": 1.001})] == scaled_reference

    # Keyed references still catch a real change of physics under the same kwargs.
    hotfix(root, "kwdrift", set_scale(1.001))
    code, summary = smoke_json(root)
    assert (code, summary["counts"]) == (1, {"drifted": 1}), summary
    assert "energy_per_atom" in summary["results"][0]["message"]


FP = {"energy_per_atom": -3.9, "force_norm": 1.2, "stress": [0.1, 0.1, 0.1, 0.0, 0.0, 0.0]}
BUILD = {"build_id": "b1", "source_hash": "sha256:a", "built_at": None, "lock_hash": None}


def _v1_manifest() -> dict:
    """A schema-1 manifest as rootstock 1 wrote it: one reference, no kwargs anywhere."""
    reference = {"fingerprint": FP, "at": "2025-01-01T00:00:00+00:00", "build": BUILD}
    record = {
        "state": "verified", "at": "2025-01-01T00:00:00+00:00", "device": "cpu",
        "device_kind": "cpu", "message": None, "fingerprint": FP, "reference": reference,
        "drift": None, "checks": None, "build": BUILD,
    }  # fmt: skip
    checkpoint = {"fetched_at": "2025-01-01T00:00:00+00:00",
                  "verifications": {"della": {"cpu": record}}}  # fmt: skip
    env = {"build_id": "b1", "source_hash": "sha256:a", "checkpoints": {"mace-mp": checkpoint}}
    return {"schema_version": 1, "clusters": ["della"], "envs": {"mace": env}}


def test_a_schema_1_reference_is_adopted_then_kwargs_are_kept_apart(tmp_path: Path):
    layout = InstallLayout(tmp_path, tmp_path)
    layout.manifest_file.write_text(json.dumps(_v1_manifest()))

    migrated = load_manifest(layout)
    assert migrated["schema_version"] == MANIFEST_VERSION
    record = migrated["envs"]["mace"]["checkpoints"]["mace-mp"]["verifications"]["della"]["cpu"]
    assert record["kwargs"] is None
    assert record["references"] == {"unrecorded": record["reference"]}

    def verify(kwargs: dict, fingerprint: dict) -> dict:
        result = {"passed": True, "device": "cpu", "fingerprint": fingerprint, "kwargs": kwargs}
        return record_verification(layout, "mace", "mace-mp", "della", result)

    # The first pass after the upgrade is judged against the old reference, and
    # files it under its own kwargs from then on.
    moved = {**FP, "energy_per_atom": -3.8}
    assert verify({"modal": "PBE"}, moved)["state"] == "drifted"
    stored = verify({"modal": "PBE"}, FP)
    assert stored["state"] == "verified"
    assert list(stored["references"]) == [kwargs_key({"modal": "PBE"})]
    # Another model (modal=R2SCAN) is not a drift of the first: it sets its own.
    other = verify({"modal": "R2SCAN"}, moved)
    assert other["state"] == "verified" and other["reference"]["kwargs"] == {"modal": "R2SCAN"}
    assert verify({"modal": "PBE"}, FP)["state"] == "verified"
    assert verify({"modal": "R2SCAN"}, FP)["state"] == "drifted"
    on_disk = json.loads(layout.manifest_file.read_text())
    assert on_disk["schema_version"] == MANIFEST_VERSION
