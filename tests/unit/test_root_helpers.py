"""The install-layer helpers that ``init`` and ``install`` share.

``suggest_cluster`` (:mod:`rootstock.install.clusters`) names the cluster of a root
that does not say; ``maintainer_umask`` (:mod:`rootstock.install.perms`) keeps what
a maintainer's command writes group-writable. Both lived in ``ops/`` and tied
``ops/init`` and ``ops/install`` into an import cycle.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.install.machine import default_cluster_name, suggest_cluster
from rootstock.install.manifest import ensure_manifest
from rootstock.install.perms import maintainer_umask

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    def set_host(name: str) -> None:
        monkeypatch.setattr(socket, "gethostname", lambda: name)

    return set_host


def test_the_default_cluster_is_the_short_lower_case_host_name(host):
    host("Login07.Cluster.Example.org")
    assert default_cluster_name() == "login07"
    host("")
    assert default_cluster_name() == "local"


def test_a_bare_root_suggests_the_host(tmp_path, host):
    host("node12.example")
    assert suggest_cluster(tmp_path / "nowhere") == "node12"


def test_the_registry_entry_of_the_root_wins_over_the_host(tmp_path, host, monkeypatch):
    host("node12")
    root = tmp_path / "root"
    registry = tmp_path / "clusters.toml"
    registry.write_text(f'[clusters.mybox]\nroot = "{root}"\n')
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(registry))
    assert suggest_cluster(root) == "mybox"
    assert suggest_cluster(tmp_path / "other") == "node12"


def test_the_manifest_of_the_root_wins_over_registry_and_host(tmp_path, host, monkeypatch):
    host("node12")
    root = tmp_path / "root"
    root.mkdir()
    registry = tmp_path / "clusters.toml"
    registry.write_text(f'[clusters.mybox]\nroot = "{root}"\n')
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(registry))
    ensure_manifest(InstallLayout(root, root), ["served1", "served2"])
    assert suggest_cluster(root) == "served1"


def test_maintainer_umask_makes_files_group_writable_and_restores_the_umask(tmp_path: Path):
    previous = os.umask(0o077)
    try:
        with maintainer_umask():
            (tmp_path / "shared").write_text("x")
            assert os.umask(0o002) == 0o002
        mode = stat.S_IMODE((tmp_path / "shared").stat().st_mode)
        assert mode == 0o664
        with pytest.raises(RuntimeError), maintainer_umask():
            raise RuntimeError("a failed build")
        assert os.umask(0o077) == 0o077  # restored, even after an error
    finally:
        os.umask(previous)
