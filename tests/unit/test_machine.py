"""The one resolver of root, cache root and cluster (:mod:`rootstock.install.machine`).

Each part of the :class:`Machine` record says which rule supplied it, and
``rootstock resolve`` (``explain_resolution``) prints that record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rootstock.errors import RootNotFound, UsageError
from rootstock.install.layout import InstallLayout, write_layout
from rootstock.install.machine import (
    Machine,
    explain_resolution,
    first_root,
    resolve_machine,
)
from rootstock.install.manifest import ensure_manifest

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("private_config")]


@pytest.fixture
def config_file(private_config: Path) -> Path:
    """The test's own config.toml (its directory made)."""
    private_config.parent.mkdir(parents=True, exist_ok=True)
    return private_config


def register(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    path = tmp_path / "clusters.toml"
    path.write_text(text)
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(path))


def test_an_explicit_root_and_cache_root(tmp_path: Path):
    machine = resolve_machine(tmp_path, None, tmp_path / "cache")
    assert machine == Machine(
        root=tmp_path,
        cache_root=tmp_path / "cache",
        cluster=None,
        root_source="argument",
        cache_root_source="argument",
        cluster_source="none",
    )
    assert machine.layout == InstallLayout(tmp_path, tmp_path / "cache")


def test_each_root_rule_names_itself(tmp_path: Path, monkeypatch, config_file: Path):
    mine, env = tmp_path / "mine", tmp_path / "env"
    for root in (mine, env, tmp_path / "config"):
        root.mkdir()
    register(tmp_path, monkeypatch, f'[clusters.box]\nroot = "{mine}"\n')
    config_file.write_text(f'root = "{tmp_path / "config"}"\n')
    assert resolve_machine().root_source == "config"
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(env))
    assert (resolve_machine().root, resolve_machine().root_source) == (env, "environment")
    machine = resolve_machine(None, "BOX")
    assert (machine.root, machine.root_source, machine.registered) == (mine, "registry", "box")
    assert machine.cluster == "BOX" and machine.cluster_source == "argument"


def test_each_cache_root_rule_names_itself(tmp_path: Path, monkeypatch):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    register(
        tmp_path,
        monkeypatch,
        f'[clusters.old]\nroot = "{legacy}"\ncache_root = "{tmp_path / "scratch"}"\n',
    )
    assert resolve_machine(legacy).cache_root_source == "registry"
    assert resolve_machine(legacy).cache_root == tmp_path / "scratch"
    write_layout(legacy, tmp_path / "declared")
    assert resolve_machine(legacy).cache_root_source == "layout"
    assert resolve_machine(tmp_path).cache_root_source == "root"


def test_the_calculator_takes_the_configured_cluster(tmp_path: Path, config_file: Path):
    config_file.write_text(f'root = "{tmp_path}"\ncluster = "Home"\n')
    plain = resolve_machine()
    assert (plain.cluster, plain.cluster_source) == (None, "none")
    configured = resolve_machine(cluster_from_config=True)
    assert (configured.cluster, configured.cluster_source) == ("home", "config")
    ensure_manifest(InstallLayout(tmp_path, tmp_path), ["home", "away"])
    explicit = resolve_machine(None, "away", cluster_from_config=True)
    assert (explicit.cluster, explicit.cluster_source) == ("away", "argument")


def test_a_missing_root_is_refused_unless_asked_not_to(tmp_path: Path):
    with pytest.raises(RootNotFound, match="does not exist"):
        resolve_machine(tmp_path / "absent")
    assert resolve_machine(tmp_path / "absent", must_exist=False).root == tmp_path / "absent"


def test_an_unknown_cluster_is_refused(tmp_path: Path):
    with pytest.raises(UsageError, match="unknown cluster 'nosuchbox'"):
        resolve_machine(tmp_path, "nosuchbox")


def test_first_root_takes_an_unregistered_cluster_without_checking(tmp_path: Path, monkeypatch):
    assert first_root(None, "brandnew") is None
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(tmp_path))
    choice = first_root(None, "brandnew")
    assert choice is not None and (choice.root, choice.describe()) == (
        tmp_path,
        "$ROOTSTOCK_ROOT",
    )


def test_resolve_prints_the_record(tmp_path: Path, config_file: Path):
    config_file.write_text(f'root = "{tmp_path}"\n')
    info = explain_resolution(None, None, tmp_path / "cache")
    assert info == {
        "root": str(tmp_path),
        "root_source": f"config ({config_file})",
        "root_exists": True,
        "shadowed": [],
        "cache_root": str(tmp_path / "cache"),
        "cache_root_source": "--cache-root",
        "layout_version": None,
        "cluster": None,
        "siblings": [],
    }
    json.dumps(info)  # the --json document
