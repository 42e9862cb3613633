"""Hostile input files are refused by name, never misread, never waited on (issue 28).

* A JSON object with a duplicate key is refused by the strict reader, in every file
  it reads: Python's ``json`` keeps the last value, so a stray ``"envs": {}`` at the
  end of ``manifest.json`` would otherwise empty every env record, and the next
  write would store the loss.
* A ``manifest.json`` that is a symbolic link is refused by every write: the write
  renames a new file into place, which would replace the link and leave its target
  behind, silently out of date.
* A built env whose ``env_source.py`` is not a regular file (a directory, a FIFO)
  shows as broken, like one that does not parse; it no longer vanishes.
* ``config.toml``, the cluster registry, ``layout.json`` and an env's
  ``rootstock-env.json`` are read only when they are regular files, and only up to a
  cap: an enormous file is refused at once by its size, and a FIFO never blocks.

The installs are real (``init_root``); the ``emt`` env is a FAKE (its
``env_source.py`` copied into ``envs/emt/``, no interpreter), which is all that
``status`` reads. Sizes come from sparse files, so nothing large is written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.errors import ConfigError, LayoutError, ManifestError
from rootstock.install.clusters import load_registry
from rootstock.install.config import load_config
from rootstock.install.envs import read_env_metadata
from rootstock.install.layout import InstallLayout, read_layout
from rootstock.install.manifest import (
    ensure_manifest,
    load_manifest,
    parse_manifest,
    update_manifest,
)
from rootstock.install.parsing import SMALL_FILE_MAX_BYTES, ParseProblem, loads_json
from rootstock.ops.init import InitRequest, init_root
from rootstock.ops.status import status

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
SAMPLE_EMT = REPO / "environments" / "emt.py"
# The size of the config.toml the review found: status took 26 s to refuse it.
HUGE = 150 * 2**20
# Refusing by size reads nothing, so it is quick even on a loaded machine.
QUICK_S = 5.0


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private config.toml path (no file yet); no root or registry from the environment."""
    config = tmp_path / "user" / "config.toml"
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(config))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    return config


@pytest.fixture
def install(tmp_path: Path) -> Path:
    """A real initialised root with a FAKE emt env (an env_source.py, no interpreter)."""
    root = tmp_path / "root"
    init_root(InitRequest(root=root, cluster="testbox"))
    env_dir = root / "envs" / "emt"
    env_dir.mkdir(parents=True)
    shutil.copyfile(SAMPLE_EMT, env_dir / "env_source.py")
    return root


def run_cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    """Run one rootstock command in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_clean_failure(code: int, err: str) -> None:
    assert code == 1, err
    assert err.startswith("error: "), err
    assert "\n  hint: " in err, err
    assert "Traceback" not in err, err


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk space (``truncate -s``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def fifo(path: Path) -> Path:
    """A named pipe nobody writes to: reading it would block for ever."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


# --- duplicate keys ------------------------------------------------------------------

DUPLICATES = {
    "top-level": ('{"envs": {"a": 1}, "envs": {}}', "envs"),
    "nested": ('{"envs": {"emt": {"build_id": "x", "build_id": null}}}', "build_id"),
    "in-an-array": ('[{"k": 1}, {"k": 2, "k": 3}]', "k"),
    "escaped-spelling": ('{"a": 1, "\\u0061": 2}', "a"),
}


@pytest.mark.parametrize("walked_by_caller", [False, True])
@pytest.mark.parametrize("variant", DUPLICATES)
def test_loads_json_refuses_a_duplicate_key(variant: str, walked_by_caller: bool):
    text, key = DUPLICATES[variant]
    with pytest.raises(ParseProblem) as info:
        loads_json(text, walked_by_caller=walked_by_caller)
    assert f"duplicate key {json.dumps(key)}" in str(info.value)
    with pytest.raises(ParseProblem, match="duplicate key"):
        loads_json(text.encode(), walked_by_caller=walked_by_caller)


def test_loads_json_reads_the_same_key_in_different_objects():
    value = loads_json('{"a": {"k": 1}, "b": {"k": 2}, "c": [{"k": 3}, {"k": 4}], "k": 5}')
    assert value == {"a": {"k": 1}, "b": {"k": 2}, "c": [{"k": 3}, {"k": 4}], "k": 5}


def test_a_manifest_with_a_duplicate_key_is_refused_and_left_untouched(install: Path):
    layout = InstallLayout(install, install)
    path = layout.manifest_file
    good = path.read_bytes().rstrip()
    assert good.endswith(b"}")
    hostile = good[:-1] + b', "envs": {}}\n'
    path.write_bytes(hostile)
    for read in (lambda: load_manifest(layout), lambda: parse_manifest(hostile, path)):
        with pytest.raises(ManifestError) as info:
            read()
        assert str(path) in info.value.message
        assert 'duplicate key "envs"' in info.value.message
        assert "left untouched" in (info.value.hint or "")
    with pytest.raises(ManifestError, match='duplicate key "envs"'):
        update_manifest(layout, lambda data: data["clusters"].append("other"))
    assert path.read_bytes() == hostile


# --- a symlinked manifest.json -----------------------------------------------------------


@pytest.fixture
def linked_manifest(install: Path, tmp_path: Path) -> tuple[InstallLayout, Path]:
    """The install's manifest moved elsewhere, with a symbolic link in its place."""
    layout = InstallLayout(install, install)
    target = tmp_path / "elsewhere" / "manifest.json"
    target.parent.mkdir()
    shutil.move(layout.manifest_file, target)
    layout.manifest_file.symlink_to(target)
    return layout, target


def assert_link_refusal(error: ManifestError, layout: InstallLayout, target: Path) -> None:
    assert str(layout.manifest_file) in error.message
    assert "symbolic link" in error.message
    assert str(target) in error.message
    assert error.hint and "replace the link" in error.hint and str(target) in error.hint


def test_a_write_through_a_symlinked_manifest_is_refused(linked_manifest):
    layout, target = linked_manifest
    before = target.read_bytes()
    # Reads follow the link: what they see is the file's true content.
    assert load_manifest(layout)["clusters"] == ["testbox"]
    with pytest.raises(ManifestError) as info:
        update_manifest(layout, lambda data: data["clusters"].append("other"))
    assert_link_refusal(info.value, layout, target)
    with pytest.raises(ManifestError) as info:
        ensure_manifest(layout, ["other"], force=True)
    assert_link_refusal(info.value, layout, target)
    assert layout.manifest_file.is_symlink()
    assert os.readlink(layout.manifest_file) == str(target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in layout.root.iterdir() if "manifest" in p.name) == [
        "manifest.json"
    ]


def test_a_dangling_manifest_link_is_refused_too(linked_manifest):
    layout, target = linked_manifest
    target.unlink()
    with pytest.raises(ManifestError) as info:
        update_manifest(layout, lambda data: data["clusters"].append("other"))
    assert str(layout.manifest_file) in info.value.message
    assert str(target) in info.value.message
    assert layout.manifest_file.is_symlink() and not target.exists()


def test_the_cli_refuses_to_write_through_a_symlinked_manifest(capsys, linked_manifest):
    layout, target = linked_manifest
    before = target.read_bytes()
    code, _out, err = run_cli(capsys, "manifest", "init", "--root", layout.root, "--cluster", "b")
    assert_clean_failure(code, err)
    assert "symbolic link" in err
    assert layout.manifest_file.is_symlink() and target.read_bytes() == before


# --- env_source.py that is not a regular file ------------------------------------------


def replace_env_source(install: Path, how: str) -> Path:
    path = install / "envs" / "emt" / "env_source.py"
    path.unlink()
    if how == "directory":
        path.mkdir()
    else:
        fifo(path)
    return path


@pytest.mark.parametrize("how", ["directory", "fifo"])
def test_env_source_that_is_not_a_file_shows_the_env_broken(capsys, install: Path, how: str):
    path = replace_env_source(install, how)
    doc = status(InstallLayout(install, install))
    rows = {row["name"]: row for row in doc["envs"]}
    assert rows["emt"]["state"] == "broken"
    assert rows["emt"]["error"].startswith(f"{path}:1: ")
    assert "not a regular file" in rows["emt"]["error"]
    assert any(f"env 'emt' is broken: {path}:1:" in line for line in doc["warnings"])

    code, out, err = run_cli(capsys, "status", "--json", "--root", install)
    assert code == 0, err
    assert {row["name"]: row["state"] for row in json.loads(out)["envs"]} == {"emt": "broken"}
    code, out, err = run_cli(capsys, "status", "--root", install)
    assert code == 0, err
    assert "broken" in out and f"env 'emt' is broken: {path}:1:" in err


# --- capped, regular-file-only reads of small inputs -------------------------------------


def assert_too_large(message: str, path: Path, started: float) -> None:
    assert time.monotonic() - started < QUICK_S
    assert str(path) in message
    assert f"{HUGE:,} bytes" in message
    assert f"{SMALL_FILE_MAX_BYTES:,}" in message


def test_an_oversized_config_is_refused_by_its_size(capsys, isolated: Path):
    sparse(isolated, HUGE)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config()
    assert_too_large(info.value.message, isolated, started)
    assert info.value.hint
    started = time.monotonic()
    code, _out, err = run_cli(capsys, "status")
    assert_clean_failure(code, err)
    assert_too_large(err.splitlines()[0], isolated, started)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_config_that_is_not_a_regular_file_is_refused(capsys, isolated: Path, kind: str):
    if kind == "fifo":
        fifo(isolated)
    else:
        isolated.mkdir(parents=True)
    with pytest.raises(ConfigError) as info:
        load_config()
    assert str(isolated) in info.value.message
    assert "not a regular file" in info.value.message
    code, _out, err = run_cli(capsys, "status")
    assert_clean_failure(code, err)
    assert "not a regular file" in err


def test_a_config_at_the_cap_is_still_read(isolated: Path):
    isolated.parent.mkdir(parents=True)
    line = b'root = "/shared/rootstock"\n'
    isolated.write_bytes(line + b"#" * (SMALL_FILE_MAX_BYTES - len(line) - 1) + b"\n")
    assert isolated.stat().st_size == SMALL_FILE_MAX_BYTES
    assert load_config()["root"] == "/shared/rootstock"


@pytest.mark.parametrize("kind", ["huge", "fifo"])
def test_the_cluster_registry_is_capped_and_must_be_a_regular_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
):
    path = tmp_path / "clusters.toml"
    sparse(path, HUGE) if kind == "huge" else fifo(path)
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(path))
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_registry()
    if kind == "huge":
        assert_too_large(info.value.message, path, started)
    else:
        assert str(path) in info.value.message and "not a regular file" in info.value.message
    assert info.value.hint


@pytest.mark.parametrize("kind", ["huge", "fifo"])
def test_layout_json_is_capped_and_must_be_a_regular_file(capsys, install: Path, kind: str):
    path = install / "layout.json"
    path.unlink()
    sparse(path, HUGE) if kind == "huge" else fifo(path)
    started = time.monotonic()
    with pytest.raises(LayoutError) as info:
        read_layout(install)
    if kind == "huge":
        assert_too_large(info.value.message, path, started)
    else:
        assert str(path) in info.value.message and "not a regular file" in info.value.message
    code, _out, err = run_cli(capsys, "status", "--root", install)
    assert_clean_failure(code, err)


def test_env_metadata_that_is_a_fifo_does_not_hang_status(install: Path):
    layout = InstallLayout(install, install)
    fifo(install / "envs" / "emt" / "rootstock-env.json")
    assert read_env_metadata(layout, "emt") is None  # unreadable metadata, as before
    rows = {row["name"]: row for row in status(layout)["envs"]}
    assert rows["emt"]["python"] is None
