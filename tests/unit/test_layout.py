"""Root and cache-root resolution, layout.json, and the cluster registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rootstock.errors import ConfigError, LayoutError, RootNotFound, UsageError
from rootstock.install.clusters import (
    BUILTIN_CLUSTERS_FILE,
    builtin_clusters,
    clusters_for_root,
    get_cluster,
    load_registry,
    read_registry_file,
)
from rootstock.install.layout import LAYOUT_VERSION, read_layout, write_layout
from rootstock.install.machine import (
    explain_resolution,
    resolve_cache_root,
    resolve_layout,
    resolve_root,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty config; no root or site registry from the environment."""
    config = tmp_path / "config.toml"
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(config))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    return config


def write_config(path: Path, root: Path) -> None:
    path.write_text(f'root = "{root}"\n')


def write_clusters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    path = tmp_path / "clusters.toml"
    path.write_text(text)
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(path))
    return path


# --- root -----------------------------------------------------------------


def test_root_flag_beats_everything(tmp_path, monkeypatch, clean_env):
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(tmp_path / "from-env"))
    write_config(clean_env, tmp_path / "from-config")
    assert resolve_root(tmp_path / "flag", cluster="della") == tmp_path / "flag"


def test_cluster_beats_env_and_config(tmp_path, monkeypatch, clean_env):
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(tmp_path / "from-env"))
    write_config(clean_env, tmp_path / "from-config")
    assert resolve_root(None, cluster="della") == builtin_clusters()["della"].root


def test_env_beats_config(tmp_path, monkeypatch, clean_env):
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(tmp_path / "from-env"))
    write_config(clean_env, tmp_path / "from-config")
    assert resolve_root() == tmp_path / "from-env"


def test_config_supplies_root_without_cluster(tmp_path, clean_env):
    write_config(clean_env, tmp_path / "from-config")
    assert resolve_root() == tmp_path / "from-config"


def test_cluster_supplies_its_registry_root():
    assert resolve_root(None, cluster="della") == builtin_clusters()["della"].root
    assert resolve_root(None, cluster="DELLA") == builtin_clusters()["della"].root


def test_root_and_cluster_together_use_root(tmp_path):
    assert resolve_root(tmp_path, cluster="perlmutter") == tmp_path


def test_root_with_unregistered_cluster_its_manifest_names_resolves(tmp_path):
    # An unregistered shared install picks its variants with root= and cluster=.
    (tmp_path / "manifest.json").write_text(
        '{"schema_version": 1, "clusters": ["not-in-any-registry"], "envs": {}}\n'
    )
    layout = resolve_layout(tmp_path, cluster="not-in-any-registry")
    assert layout.root == tmp_path
    assert layout.cache_root == tmp_path


def test_root_with_unregistered_cluster_and_no_manifest_is_refused(tmp_path):
    with pytest.raises(UsageError, match="unknown cluster 'not-in-any-registry'"):
        resolve_layout(tmp_path, cluster="not-in-any-registry")


def test_relative_and_user_roots_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_root("rel") == tmp_path / "rel"
    assert resolve_root("~/r") == tmp_path / "home" / "r"


def test_no_root_at_all_says_how_to_give_one():
    with pytest.raises(RootNotFound) as info:
        resolve_root()
    # In Python terms for a script, in options for the CLI (which shows cli_hint).
    hint, cli_hint = info.value.hint or "", info.value.cli_hint or ""
    assert "root=PATH" in hint and "--root" not in hint
    assert "--root PATH" in cli_hint
    assert "ROOTSTOCK_ROOT" in hint and "ROOTSTOCK_ROOT" in cli_hint


def test_missing_root_is_refused_when_it_must_exist(tmp_path):
    with pytest.raises(RootNotFound, match="does not exist"):
        resolve_layout(tmp_path / "absent")
    assert resolve_layout(tmp_path / "absent", must_exist=False).root == tmp_path / "absent"


def test_unknown_cluster_without_root_lists_known_names():
    with pytest.raises(UsageError) as info:
        resolve_root(None, cluster="nosuchbox")
    for name in ("della", "delta", "sophia", "polaris", "perlmutter", "aurora"):
        assert name in info.value.message
    assert "ROOTSTOCK_CLUSTERS_FILE" in info.value.hint


# --- cache root -------------------------------------------------------------


def test_override_beats_layout_declaration(tmp_path):
    write_layout(tmp_path, tmp_path / "declared")
    assert resolve_cache_root(tmp_path, tmp_path / "override") == tmp_path / "override"


def test_layout_declaration_beats_registry(tmp_path, monkeypatch):
    write_clusters(
        tmp_path,
        monkeypatch,
        f'[clusters.box]\nroot = "{tmp_path}"\ncache_root = "{tmp_path / "legacy"}"\n',
    )
    write_layout(tmp_path, tmp_path / "declared")
    assert resolve_cache_root(tmp_path) == tmp_path / "declared"
    assert resolve_cache_root(tmp_path, cluster="box") == tmp_path / "declared"


def test_layout_declaring_the_root_itself_beats_registry(tmp_path, monkeypatch):
    # "cache_root": null declares the root itself; a registry entry must not re-point it.
    write_clusters(
        tmp_path,
        monkeypatch,
        f'[clusters.box]\nroot = "{tmp_path}"\ncache_root = "{tmp_path / "legacy"}"\n',
    )
    write_layout(tmp_path, None)
    assert json.loads((tmp_path / "layout.json").read_text())["cache_root"] is None
    assert resolve_cache_root(tmp_path, cluster="box") == tmp_path
    assert explain_resolution(tmp_path)["cache_root_source"] == "layout.json"


def test_legacy_root_takes_registry_cache_root(tmp_path, monkeypatch):
    legacy = tmp_path / "legacy-root"
    legacy.mkdir()
    (legacy / "manifest.json").write_text("{}")  # predates layout.json
    write_clusters(
        tmp_path,
        monkeypatch,
        f'[clusters.oldbox]\nroot = "{legacy}"\ncache_root = "{tmp_path / "scratch"}"\n',
    )
    assert resolve_cache_root(legacy) == tmp_path / "scratch"
    assert resolve_cache_root(legacy, cluster="oldbox") == tmp_path / "scratch"
    # An unrelated cluster name does not lend its cache root to this root.
    assert resolve_cache_root(legacy, cluster="perlmutter") == tmp_path / "scratch"
    info = explain_resolution(legacy, cluster="oldbox")
    assert info["cache_root_source"] == "cluster registry (legacy cache_root)"
    assert info["layout_version"] is None


def test_registry_cache_root_of_another_root_is_ignored(tmp_path, monkeypatch):
    # elsewhere's legacy cache root belongs to elsewhere's root, not to this one.
    write_clusters(
        tmp_path,
        monkeypatch,
        f'[clusters.elsewhere]\nroot = "{tmp_path / "other"}"\n'
        f'cache_root = "{tmp_path / "scratch"}"\n',
    )
    assert resolve_cache_root(tmp_path, cluster="elsewhere") == tmp_path


def test_root_itself_is_the_last_resort(tmp_path):
    assert resolve_cache_root(tmp_path) == tmp_path
    assert explain_resolution(tmp_path)["cache_root_source"] == "the install root itself"


def test_layout_round_trip(tmp_path):
    written = write_layout(tmp_path, tmp_path / "cache")
    on_disk = read_layout(tmp_path)
    assert on_disk == written
    assert on_disk["layout_version"] == LAYOUT_VERSION
    assert on_disk["cache_root"] == str(tmp_path / "cache")
    assert read_layout(tmp_path / "nothing-here") is None


def test_newer_layout_version_is_refused_with_upgrade_hint(tmp_path):
    (tmp_path / "layout.json").write_text(
        json.dumps({"layout_version": LAYOUT_VERSION + 1, "cache_root": None})
    )
    with pytest.raises(LayoutError) as info:
        read_layout(tmp_path)
    assert f"layout version {LAYOUT_VERSION + 1}" in info.value.message
    assert "upgrade rootstock" in info.value.hint
    with pytest.raises(LayoutError):
        resolve_cache_root(tmp_path)


@pytest.mark.parametrize(
    "text",
    ["{not json", "[1, 2]", '{"cache_root": null}', '{"layout_version": "1"}', ""],
    ids=["syntax", "not-object", "no-version", "string-version", "empty"],
)
def test_corrupt_layout_is_refused(tmp_path, text):
    (tmp_path / "layout.json").write_text(text)
    with pytest.raises(LayoutError, match=r"layout\.json"):
        read_layout(tmp_path)
    with pytest.raises(LayoutError):
        resolve_layout(tmp_path)


# --- explain_resolution -------------------------------------------------------


def test_explain_names_each_root_source(tmp_path, monkeypatch, clean_env):
    assert explain_resolution(tmp_path)["root_source"] == "--root"
    assert explain_resolution(None, cluster="della")["root_source"] == "cluster registry (della)"
    write_config(clean_env, tmp_path)
    assert explain_resolution()["root_source"].startswith("config (")
    assert explain_resolution(None, cluster="della")["root_source"] == "cluster registry (della)"
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(tmp_path))
    assert explain_resolution()["root_source"] == "$ROOTSTOCK_ROOT"


def test_explain_reports_override_and_declaration(tmp_path):
    write_layout(tmp_path, tmp_path / "declared")
    info = explain_resolution(tmp_path, cache_root=tmp_path / "o")
    assert (info["cache_root"], info["cache_root_source"]) == (str(tmp_path / "o"), "--cache-root")
    info = explain_resolution(tmp_path)
    assert (info["cache_root"], info["cache_root_source"]) == (
        str(tmp_path / "declared"),
        "layout.json",
    )
    assert info["layout_version"] == LAYOUT_VERSION
    assert info["root_exists"] is True


# --- the registry -------------------------------------------------------------


def test_builtin_clusters():
    assert set(builtin_clusters()) == {
        "della",
        "delta",
        "sophia",
        "polaris",
        "perlmutter",
        "aurora",
    }
    # No entry carries one person's scratch directory as a legacy cache root.
    assert all(c.cache_root is None for c in builtin_clusters().values())
    assert builtin_clusters()["sophia"].root == builtin_clusters()["polaris"].root


def test_builtin_clusters_ship_as_a_data_file():
    # The same file form a site's $ROOTSTOCK_CLUSTERS_FILE uses, so a site can replace it.
    assert BUILTIN_CLUSTERS_FILE.name == "clusters.toml"
    assert read_registry_file(BUILTIN_CLUSTERS_FILE) == builtin_clusters()


def test_siblings_share_a_root():
    shared = builtin_clusters()["sophia"].root
    assert sorted(c.name for c in clusters_for_root(shared)) == ["polaris", "sophia"]
    assert sorted(explain_resolution(None, cluster="polaris")["siblings"]) == [
        "polaris",
        "sophia",
    ]
    assert [c.name for c in clusters_for_root(builtin_clusters()["della"].root)] == ["della"]


def test_site_file_extends_and_overrides(tmp_path, monkeypatch):
    write_clusters(
        tmp_path,
        monkeypatch,
        f"""
[clusters.mybox]
root = "{tmp_path / "mine"}"

[clusters.Della]
root = "{tmp_path / "della-moved"}"
cache_root = "{tmp_path / "della-cache"}"
""",
    )
    registry = load_registry()
    assert registry["mybox"].root == tmp_path / "mine"
    assert registry["mybox"].cache_root is None
    assert registry["della"].root == tmp_path / "della-moved"
    assert registry["della"].cache_root == tmp_path / "della-cache"
    assert "aurora" in registry  # built-ins that the file does not name remain
    assert resolve_root(None, cluster="mybox") == tmp_path / "mine"
    assert get_cluster("MyBox").name == "mybox"


def test_site_file_siblings(tmp_path, monkeypatch):
    write_clusters(
        tmp_path,
        monkeypatch,
        f'[clusters.a]\nroot = "{tmp_path}"\n[clusters.b]\nroot = "{tmp_path}"\n',
    )
    assert sorted(c.name for c in clusters_for_root(tmp_path)) == ["a", "b"]


@pytest.mark.parametrize(
    "text",
    [
        "[clusters.x\nroot = '/r'\n",
        "[clusters.x]\ncache_root = '/c'\n",
        "[clusters.x]\nroot = 3\n",
        "clusters = 'nope'\n",
        "[clusters]\nx = 'not a table'\n",
    ],
    ids=["bad-toml", "no-root", "root-not-string", "clusters-not-table", "entry-not-table"],
)
def test_malformed_site_file_is_a_config_error(tmp_path, monkeypatch, text):
    path = write_clusters(tmp_path, monkeypatch, text)
    with pytest.raises(ConfigError) as info:
        load_registry()
    assert str(path) in info.value.message


def test_missing_site_file_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_registry()


def test_unknown_cluster_lists_site_names_too(tmp_path, monkeypatch):
    write_clusters(tmp_path, monkeypatch, f'[clusters.mybox]\nroot = "{tmp_path}"\n')
    with pytest.raises(UsageError) as info:
        get_cluster("elsewhere")
    assert "'elsewhere'" in info.value.message
    assert "mybox" in info.value.message
    assert "della" in info.value.message
