"""``CHECKPOINT_INFO`` as the commands show it: ``info``, ``list`` and ``status``.

The install is made by hand (a built env's files, its build metadata and lockfile,
manifest records written through the manifest API), so no uv and no worker run.
"""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.install.envfile import source_hash
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    ensure_manifest,
    record_env_build,
    record_fetch,
    record_verification,
)
from rootstock.ops.status import status
from rootstock.runtime.provenance import build_provenance
from rootstock.runtime.spec import WorkerSpec
from rootstock.version import __version__

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("private_config")]

GATED = "https://huggingface.co/example-org/toy"
SOURCE = textwrap.dedent(
    f'''\
    """A toy env with three kinds of checkpoint."""

    # /// script
    # requires-python = ">=3.11"
    # dependencies = ["toy-model>=1", "torch", "ase>=3.23", "numpy"]
    # ///

    CHECKPOINTS = {{
        "toy-open": "open",
        "toy-asl": "asl",
        "toy-gated": "gated",
        "toy:custom": None,
    }}

    CHECKPOINT_INFO = {{
        "toy-open": {{
            "licence": "MIT",
            "gated": None,
            "citation": "arXiv:2401.00096",
            "training_data": "MPtrj",
            "summary": "an open toy",
        }},
        "toy-asl": {{"licence": "custom:https://github.com/gabor1/ASL"}},
        "toy-gated": {{"gated": "{GATED}", "licence": "MIT"}},
    }}


    def setup(checkpoint, device="cuda", **kw):
        from ase.calculators.emt import EMT

        return EMT()


    def setup_from_path(path, device="cuda", **kw):
        return setup(path, device)
    '''
)
# A uv script lock, cut down: numpy resolved twice (one per Python), torch once.
LOCK = """\
version = 1
[[package]]
name = "toy-model"
version = "1.2.0"
[[package]]
name = "torch"
version = "2.7.1"
[[package]]
name = "numpy"
version = "2.4.6"
[[package]]
name = "numpy"
version = "2.5.5"
[[package]]
name = "ase"
version = "3.29.0"
"""
BUILD_ID = "1700000000-abcdef"
CHECKS = {
    "ok": True,
    "dtype": "float64",
    "forces": {"mode": "gradient", "ok": True, "ratio": 1.0004},
    "stress": {"mode": "gradient", "ok": True, "ratio": 0.9991},
}


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    """A root with the toy env built by hand; toy-open fetched (two files) and verified."""
    root = tmp_path / "root"
    made = InstallLayout(root, root)
    for directory in (made.environments_dir, made.envs_dir, made.cache_dir, made.home_dir):
        directory.mkdir(parents=True)
    ensure_manifest(made, ["testbox"])
    generation = made.envs_dir / f".toy.{BUILD_ID}"
    generation.mkdir()
    (generation / "env_source.py").write_text(SOURCE)
    (generation / "env_source.py.lock").write_text(LOCK)
    metadata = {
        "build_id": BUILD_ID,
        "built_at": "2026-01-02T03:04:05+00:00",
        "versions": {"python": "3.11.2", "numpy": "2.4.6", "torch": "2.7.1"},
        "image": None,
    }
    (generation / "rootstock-env.json").write_text(json.dumps(metadata))
    made.env_dir("toy").symlink_to(generation.name)
    record_env_build(made, "toy", {"source_hash": source_hash(SOURCE), "build_id": BUILD_ID})
    hashed, unhashed = made.cache_dir / "toy" / "open.pt", made.cache_dir / "toy" / "extra.json"
    hashed.parent.mkdir(parents=True)
    hashed.write_bytes(b"w" * 1000)
    unhashed.write_bytes(b"{}" * 21)
    files = sorted(os.path.relpath(p, made.cache_root) for p in (hashed, unhashed))
    weight = {"size": 1000, "sha256": "ab" * 32, "mtime": hashed.stat().st_mtime}
    record_fetch(made, "toy", "toy-open", files=files, weights={files[1]: weight})
    record_verification(
        made,
        "toy",
        "toy-open",
        "testbox",
        {
            "passed": True,
            "device": "cpu",
            "fingerprint": {"energy_per_atom": -1.0, "force_norm": 0.1, "natoms": 4},
            "checks": CHECKS,
            "build": {"build_id": BUILD_ID, "source_hash": source_hash(SOURCE)},
        },
    )
    return made


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_json_holds_the_build_the_files_and_the_verifications(layout, capsys):
    code, out, _err = run(capsys, "info", "toy-open", "--root", str(layout.root), "--json")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == {
        "checkpoint",
        "env",
        "upstream",
        "custom",
        "info",
        "build",
        "fetched_at",
        "files",
        "verifications",
    }
    assert (doc["checkpoint"], doc["env"], doc["upstream"], doc["custom"]) == (
        "toy-open",
        "toy",
        "open",
        False,
    )
    assert doc["info"] == {
        "licence": "MIT",
        "gated": None,
        "citation": "arXiv:2401.00096",
        "training_data": "MPtrj",
        "summary": "an open toy",
    }
    build = doc["build"]
    assert (build["build_id"], build["python"], build["image"]) == (BUILD_ID, "3.11.2", None)
    assert build["lockfile"] == str(layout.env_dir("toy") / "env_source.py.lock")
    # The model package and torch from the lock; numpy's two versions settled by the
    # one this build installed.
    assert build["packages"] == {
        "toy-model": "1.2.0",
        "torch": "2.7.1",
        "ase": "3.29.0",
        "numpy": "2.4.6",
    }
    assert doc["fetched_at"]
    by_path = {row["path"]: row for row in doc["files"]}
    assert by_path["cache/toy/open.pt"] == {
        "path": "cache/toy/open.pt",
        "size": 1000,
        "sha256": "ab" * 32,
        "present": True,
    }
    # Not hashed by add: its size comes from the disk, and no digest is made up.
    assert by_path["cache/toy/extra.json"] == {
        "path": "cache/toy/extra.json",
        "size": 42,
        "sha256": None,
        "present": True,
    }
    (verification,) = doc["verifications"]
    assert verification["cluster"] == "testbox"
    assert (verification["device_kind"], verification["device"]) == ("cpu", "cpu")
    assert (verification["state"], verification["build_id"]) == ("verified", BUILD_ID)
    assert verification["checks"]["forces"]["ratio"] == 1.0004
    assert verification["checks"]["stress"]["ratio"] == 0.9991


def test_info_for_people_names_each_fact(layout, capsys):
    (layout.cache_dir / "toy" / "open.pt").unlink()
    code, out, _err = run(capsys, "info", "toy-open", "--root", str(layout.root))
    assert code == 0
    assert "licence:       MIT" in out
    assert "gated:         not gated" in out
    assert "citation:      arXiv:2401.00096" in out
    assert f"build id:      {BUILD_ID}" in out
    assert "toy-model 1.2.0, torch 2.7.1" in out
    assert f"cache/toy/open.pt  1000 B  sha256 {'ab' * 32} MISSING" in out
    assert "cache/toy/extra.json  42 B  not hashed" in out
    assert "testbox/cpu: verified on cpu" in out
    assert "physics checks: forces 1.000, stress 0.999" in out


def test_info_of_a_checkpoint_never_fetched_or_verified(layout, capsys):
    code, out, _err = run(capsys, "info", "toy-gated", "--root", str(layout.root), "--json")
    doc = json.loads(out)
    assert code == 0
    assert doc["info"] == {"gated": GATED, "licence": "MIT"}
    assert (doc["fetched_at"], doc["files"], doc["verifications"]) == (None, None, [])


def test_info_of_an_unknown_id_is_one_error_naming_the_fix(layout, capsys):
    code, out, err = run(capsys, "info", "toy-opne", "--root", str(layout.root))
    assert code == 2 and out == ""
    first, *rest = err.splitlines()
    assert first.startswith("error: unknown checkpoint 'toy-opne'"), err
    assert "toy-open" in err  # the close match
    assert any("rootstock list" in line for line in rest), err


def test_list_shows_licences_and_marks_gated_ids(layout, capsys, monkeypatch):
    code, out, _err = run(capsys, "list", "--root", str(layout.root), "--json")
    assert code == 0
    (env,) = json.loads(out)["envs"]
    assert env["licences"] == {
        "toy-open": "MIT",
        "toy-asl": "custom:https://github.com/gabor1/ASL",
        "toy-gated": "MIT",
        "toy:custom": None,
    }
    assert env["gated"] == {"toy-gated": GATED}

    # A terminal wide enough that rich wraps no cell (CI's is 80 columns).
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _err = run(capsys, "list", "--root", str(layout.root))
    assert code == 0
    text = " ".join(out.split())
    assert "licence" in text
    assert "toy-gated (gated)" in text and "toy-open (gated)" not in text
    assert "MIT (toy-open, toy-gated); custom:https://github.com/gabor1/ASL (toy-asl)" in text


def test_status_shows_a_gated_checkpoint_not_yet_fetched_as_gated(layout):
    def states() -> dict[str, dict]:
        (env,) = status(layout)["envs"]
        return {row["id"]: row["states"]["testbox"] for row in env["checkpoints"]}

    before = states()
    assert before["toy-gated"]["state"] == "gated"
    assert GATED in before["toy-gated"]["message"]
    assert before["toy-asl"]["state"] == "not fetched"  # not gated: nothing to ask for
    assert before["toy-open"]["state"] == "verified"
    record_fetch(layout, "toy", "toy-gated", files=[])
    assert states()["toy-gated"]["state"] == "fetched"  # access was granted once


def test_provenance_reads_the_build_the_lock_and_the_recorded_hashes(layout):
    """What a calculator's provenance says, from the same files ``info`` reads."""
    spec = WorkerSpec(layout=layout, checkpoint="toy-open", env_name="toy", cluster="testbox")
    provenance = build_provenance(spec)
    assert provenance == {
        "checkpoint": "toy-open",
        "env": "toy",
        "build_id": BUILD_ID,
        "lockfile_sha256": hashlib.sha256(LOCK.encode()).hexdigest(),
        "packages": {"toy-model": "1.2.0", "torch": "2.7.1", "ase": "3.29.0", "numpy": "2.4.6"},
        # Only the file add hashed; the unhashed one has no digest to give.
        "weights": {"cache/toy/open.pt": "ab" * 32},
        "rootstock_version": __version__,
        "cluster": "testbox",
        "device": None,
    }
    # A checkpoint with no recorded files has no hashes.
    gated = build_provenance(WorkerSpec(layout=layout, checkpoint="toy-gated", env_name="toy"))
    assert gated["weights"] == {}


def test_provenance_of_a_build_whose_env_file_broke_keeps_what_it_can(layout):
    (layout.env_dir("toy") / "env_source.py").write_text("def setup(:\n")
    provenance = build_provenance(WorkerSpec(layout=layout, checkpoint="toy-open", env_name="toy"))
    assert provenance["packages"] == {}
    assert (provenance["build_id"], provenance["weights"]) == (
        BUILD_ID,
        {"cache/toy/open.pt": "ab" * 32},
    )
