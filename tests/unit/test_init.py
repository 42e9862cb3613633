"""``rootstock init`` called in-process: fresh roots, refusals, ``--force``.

Through the CLI (config.toml, prompts on a pseudo-terminal, Ctrl-C) the tests run
``rootstock`` in a subprocess, so they are in tests/integration/test_init_cli.py.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from rootstock.errors import RootstockError
from rootstock.install.layout import LAYOUT_VERSION, read_layout
from rootstock.ops.init import InitRequest, init_root

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("private_config")]

ROOT_DIRS = ("environments", "envs", "wheels", ".locks")
CACHE_DIRS = ("home", "cache")


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def register_legacy_cluster(tmp_path: Path, monkeypatch, root: Path, cache: Path) -> None:
    clusters = tmp_path / "clusters.toml"
    clusters.write_text(f'[clusters.oldbox]\nroot = "{root}"\ncache_root = "{cache}"\n')
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(clusters))


# --- direct calls -----------------------------------------------------------------


def test_init_creates_layout_manifest_and_dirs(tmp_path):
    root = tmp_path / "root"
    result = init_root(InitRequest(root=root, cluster="TestBox"))
    layout = json.loads((root / "layout.json").read_text())
    assert layout["layout_version"] == LAYOUT_VERSION
    assert "cache_root" in layout and layout["cache_root"] is None  # the root itself
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["clusters"] == ["testbox"]
    assert manifest["envs"] == {}
    for name in (*ROOT_DIRS, *CACHE_DIRS):
        assert (root / name).is_dir(), name
    assert (result.root, result.cache_root, result.cluster) == (root, root, "testbox")
    assert {"layout.json", "manifest.json", "envs"} <= set(result.created)


def test_init_with_separate_cache_root(tmp_path):
    root, cache = tmp_path / "root", tmp_path / "scratch" / "cache-root"
    result = init_root(InitRequest(root=root, cache_root=cache, cluster="testbox"))
    assert read_layout(root)["cache_root"] == str(cache)
    assert result.cache_root == cache
    for name in CACHE_DIRS:
        assert (cache / name).is_dir()
        assert not (root / name).exists()


def test_init_dirs_honour_umask_002(tmp_path):
    previous = os.umask(0o077)
    try:
        init_root(InitRequest(root=tmp_path / "root", cluster="testbox"))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "root" / "envs").stat().st_mode) == 0o775
    assert stat.S_IMODE((tmp_path / "root" / "layout.json").stat().st_mode) == 0o664


def test_fresh_registered_root_declares_registry_cache_root(tmp_path, monkeypatch):
    # Without --cache-root, the registry's suggestion (the prompt's default) is declared,
    # so a later release's registry can never re-point this install.
    root, cache = tmp_path / "root", tmp_path / "legacy-cache"
    register_legacy_cluster(tmp_path, monkeypatch, root, cache)
    init_root(InitRequest(root=root, cluster="oldbox"))
    assert read_layout(root)["cache_root"] == str(cache)


def test_init_refuses_a_populated_root(tmp_path):
    root = tmp_path / "root"
    init_root(InitRequest(root=root, cluster="testbox"))
    before = snapshot(root)
    with pytest.raises(RootstockError, match="already an install root") as info:
        init_root(InitRequest(root=root, cluster="other", cache_root=tmp_path / "c"))
    assert "--force" in info.value.hint
    assert snapshot(root) == before


def test_force_on_legacy_root_declares_the_cache_root_it_used(tmp_path, monkeypatch):
    root, cache = tmp_path / "legacy", tmp_path / "legacy-cache"
    (root / "envs" / "old").mkdir(parents=True)
    (root / "manifest.json").write_text('{"schema_version": 1}')
    register_legacy_cluster(tmp_path, monkeypatch, root, cache)
    init_root(InitRequest(root=root, cluster="oldbox", force=True))
    assert read_layout(root)["cache_root"] == str(cache)
    assert (root / "manifest.json").read_text() == '{"schema_version": 1}'
    assert (root / "envs" / "old").is_dir()
