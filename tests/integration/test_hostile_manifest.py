"""A hand-damaged install fails loudly on a real root, and nothing is rewritten (issue 28).

Each test works on a private copy of the session's ``emt_root`` (the sample EMT env,
built by real uv): the small files are copied, the built env's files are hard links
(a test replaces one only by unlinking it first, never by writing through it), so no
build is repeated and the shared root is never touched.

* A duplicate key in ``manifest.json`` (``, "envs": {}`` appended before the final
  brace) made ``status`` and ``add`` exit 0 with every env record gone, and ``add``
  then stored the loss. Both must refuse it, naming the file and the key, and the
  manifest must stay byte-identical.
* A ``manifest.json`` that is a symbolic link is read through, but ``add`` must not
  replace the link by a plain file.
* An ``env_source.py`` replaced by a directory made the env vanish from ``status``;
  it must show as broken, as a syntax error does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_rootstock

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def root(emt_root: Path, tmp_path: Path) -> Path:
    """A private copy of the session's built EMT root."""
    copy = tmp_path / "root"
    shutil.copytree(
        emt_root,
        copy,
        symlinks=True,
        ignore=lambda directory, _names: ["envs"] if Path(directory) == emt_root else [],
    )
    subprocess.run(
        ["cp", "-al", str(emt_root / "envs"), str(copy / "envs")], check=True, timeout=300
    )
    return copy


def rs(root: Path, *args: str):
    return run_rootstock(*args, "--root", root, check=False, timeout=600)


def assert_refused(proc, *words: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "error: " in proc.stderr and "\n  hint: " in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def test_a_duplicate_key_in_the_manifest_fails_status_and_add(root: Path):
    path = root / "manifest.json"
    good = path.read_bytes().rstrip()
    assert json.loads(good)["envs"]["emt"]["build_id"]  # the record the duplicate would hide
    assert good.endswith(b"}")
    hostile = good[:-1] + b', "envs": {}}\n'
    path.unlink()  # a fresh file, whatever the copy shares
    path.write_bytes(hostile)

    for args in (("status",), ("status", "--json"), ("add", "emt", "--device", "cpu")):
        proc = rs(root, *args)
        assert_refused(proc, str(path), 'duplicate key "envs"', "left untouched")
        assert path.read_bytes() == hostile, args


def test_add_refuses_to_replace_a_symlinked_manifest(root: Path, tmp_path: Path):
    path = root / "manifest.json"
    target = tmp_path / "elsewhere" / "manifest.json"
    target.parent.mkdir()
    shutil.move(path, target)
    path.symlink_to(target)
    before = target.read_bytes()

    # Reading through the link is harmless: status shows the install as it is.
    status = json.loads(rs(root, "status", "--json").stdout)
    assert [env["name"] for env in status["envs"]] == ["emt"]

    proc = rs(root, "add", "emt", "--device", "cpu")
    assert_refused(proc, str(path), "symbolic link", str(target), "replace the link")
    assert path.is_symlink() and target.read_bytes() == before


def test_an_env_source_replaced_by_a_directory_shows_the_env_broken(root: Path):
    source = root / "envs" / "emt" / "env_source.py"
    source.unlink()  # a hard link into the shared root: never write through it
    source.mkdir()
    location = f"{source}:1: it is a directory, not a regular file"

    proc = rs(root, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {env["name"]: env for env in json.loads(proc.stdout)["envs"]}
    assert rows["emt"]["state"] == "broken"
    assert rows["emt"]["error"] == location

    proc = rs(root, "status")
    assert proc.returncode == 0, proc.stderr
    assert "broken" in proc.stdout
    assert f"env 'emt' is broken: {location}" in proc.stderr

    # The shared root never recorded an id for emt, so "emt" is unknown (2), and
    # the hint names the broken env that may declare it.
    before = (root / "manifest.json").read_bytes()
    proc = rs(root, "add", "emt", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"env 'emt' is broken ({location})" in proc.stderr
    assert (root / "manifest.json").read_bytes() == before
