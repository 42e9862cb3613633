"""``--cluster`` / ``cluster=`` mean what they say (issue #12).

An explicit root wins; otherwise an explicit cluster supplies its registry root
before ``$ROOTSTOCK_ROOT`` and config.toml, and a cluster name that neither the
registry nor the install's manifest knows is a usage error listing the known ones.
Every CLI command and ``RootstockCalculator`` resolve the same way.

The commands run in-process through ``rootstock.cli.main.main`` (no subprocess).
The envs here are FAKES: an ``env_source.py`` copied into ``envs/NAME/`` with no
interpreter, which is all construction-time resolution reads; nothing is spawned.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.errors import UsageError
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import explain_resolution, resolve_layout, resolve_root
from rootstock.install.manifest import ensure_manifest
from rootstock.ops.init import InitRequest, init_root
from rootstock.runtime.calculator import RootstockCalculator

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SAMPLE_EMT = REPO / "environments" / "emt.py"
BUILTIN_NAMES = ("della", "delta", "sophia", "polaris", "perlmutter", "aurora")


@dataclass(frozen=True)
class Site:
    """Three initialised installs and the user settings that point at them."""

    box: Path  # the registry's root for cluster "box"
    env: Path  # what $ROOTSTOCK_ROOT names
    config: Path  # what config.toml names
    config_file: Path

    def set_config_root(self, root: Path) -> None:
        # Dashboard settings too, so `manifest push` gets as far as resolving the root;
        # port 9 (discard) is never reached, since resolution fails first.
        self.config_file.write_text(
            f'root = "{root}"\napi_url = "http://127.0.0.1:9"\n'
            'api_key = "rsk_test"\napi_secret = "not-a-secret"\n'
        )


def make_install(root: Path, *clusters: str) -> Path:
    """A real initialised root (layout.json, manifest naming ``clusters``) with a FAKE emt env."""
    init_root(InitRequest(root=root, cluster=clusters[0]))
    ensure_manifest(InstallLayout(root, root), clusters)
    env_dir = root / "envs" / "emt"
    env_dir.mkdir(parents=True)
    shutil.copyfile(SAMPLE_EMT, env_dir / "env_source.py")
    return root


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Site:
    """Registry entry ``box``; ``$ROOTSTOCK_ROOT`` and config.toml name two other installs."""
    config_file = tmp_path / "config.toml"
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(config_file))
    box = make_install(tmp_path / "box-root", "box")
    env = make_install(tmp_path / "env-root", "envbox")
    config = make_install(tmp_path / "config-root", "configbox", "shared")
    registry = tmp_path / "clusters.toml"
    registry.write_text(f'[clusters.box]\nroot = "{box}"\n')
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(registry))
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(env))
    made = Site(box=box, env=env, config=config, config_file=config_file)
    made.set_config_root(config)
    return made


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """Run one rootstock command in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- the order --------------------------------------------------------------


def test_cluster_beats_env_root_and_config_root(site: Site):
    assert resolve_root(None, cluster="box") == site.box
    assert resolve_root(None, cluster="BOX") == site.box


def test_cluster_beats_config_root(site: Site, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ROOTSTOCK_ROOT")
    assert resolve_root(None, cluster="box") == site.box


def test_explicit_root_beats_cluster(site: Site):
    assert resolve_root(site.config, cluster="box") == site.config


def test_without_cluster_env_then_config(site: Site, monkeypatch: pytest.MonkeyPatch):
    assert resolve_root() == site.env
    monkeypatch.delenv("ROOTSTOCK_ROOT")
    assert resolve_root() == site.config


# --- unknown names ------------------------------------------------------------


def test_unknown_cluster_with_root_is_a_usage_error_listing_known(site: Site):
    with pytest.raises(UsageError) as info:
        resolve_layout(site.config, cluster="boxx")
    message = info.value.message
    assert message.startswith("unknown cluster 'boxx'; known clusters: ")
    # the registry's names and the names this install's manifest serves
    for name in (*BUILTIN_NAMES, "box", "configbox", "shared"):
        assert name in message
    assert f"manifest init --root {site.config} --cluster boxx" in info.value.hint


def test_unregistered_cluster_the_manifest_names_is_accepted(site: Site):
    assert resolve_layout(site.config, cluster="Shared").root == site.config


def test_unregistered_cluster_falls_through_to_defaults_only_if_served(
    site: Site, monkeypatch: pytest.MonkeyPatch
):
    # $ROOTSTOCK_ROOT's manifest serves envbox, so envbox there is a known machine ...
    assert resolve_root(None, cluster="envbox") == site.env
    # ... but a typo must not quietly run against whatever the defaults point at.
    with pytest.raises(UsageError, match=r"unknown cluster 'configbox'.*envbox"):
        resolve_root(None, cluster="configbox")
    monkeypatch.delenv("ROOTSTOCK_ROOT")
    assert resolve_root(None, cluster="configbox") == site.config


def test_unknown_cluster_with_no_install_at_all(site: Site, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ROOTSTOCK_ROOT")
    site.config_file.unlink()
    with pytest.raises(UsageError) as info:
        resolve_root(None, cluster="nosuchbox")
    assert all(name in info.value.message for name in BUILTIN_NAMES)
    assert "--root" in info.value.hint and "ROOTSTOCK_CLUSTERS_FILE" in info.value.hint


# --- rootstock resolve ------------------------------------------------------


def test_explain_names_the_cluster_and_what_it_shadows(site: Site):
    info = explain_resolution(None, cluster="box")
    assert info["root"] == str(site.box)
    assert info["root_source"] == "cluster registry (box)"
    assert info["shadowed"] == [
        {"source": "$ROOTSTOCK_ROOT", "root": str(site.env)},
        {"source": f"config ({site.config_file})", "root": str(site.config)},
    ]


def test_explain_without_overrides_shadows_nothing(site: Site, monkeypatch):
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(site.config))
    info = explain_resolution()
    assert info["root_source"] == "$ROOTSTOCK_ROOT" and info["shadowed"] == []


def test_resolve_text_says_which_roots_are_not_used(site: Site, capsys):
    code, out, _ = run_cli(capsys, "resolve", "--cluster", "box")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"root:       {site.box}  (from cluster registry (box))")
    assert f"  not used: {site.env}  (from $ROOTSTOCK_ROOT)" in lines
    assert f"  not used: {site.config}  (from config ({site.config_file}))" in lines


# --- every command ------------------------------------------------------------

# Every command that takes --cluster to locate an install, with the rest of its
# arguments. None of them may reach an install other than the one asked for.
COMMANDS = [
    ("resolve", "--json"),
    ("status", "--json"),
    ("list", "--json"),
    ("add", "emt", "--no-verify"),
    ("smoke-test", "--json"),
    ("install", "{env_file}", "--dry-run"),
    ("serve", "emt", "--socket", "{tmp}/s.sock", "--connect-timeout", "1"),
    ("benchmark", "emt", "--device", "cpu"),
    ("manifest", "show"),
    ("manifest", "push"),
    ("usage", "report", "--json"),
    ("check-perms", "--json"),
    ("setup-perms", "--group", "nogroup"),
]


def expand(argv: tuple[str, ...], tmp_path: Path) -> list[str]:
    return [a.format(env_file=SAMPLE_EMT, tmp=tmp_path) for a in argv]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_refuses_an_unknown_cluster(site: Site, capsys, tmp_path, argv):
    argv = expand(argv, tmp_path)
    before = (site.config / "manifest.json").read_bytes()
    code, _, err = run_cli(capsys, *argv, "--cluster", "boxx")
    assert code == 2, err
    assert "unknown cluster 'boxx'; known clusters: " in err
    assert "Traceback" not in err
    assert (site.config / "manifest.json").read_bytes() == before


@pytest.mark.parametrize(
    ("argv", "shows_root"),
    [
        (("resolve", "--json"), lambda doc: doc["root"]),
        (("status", "--json"), lambda doc: doc["root"]),
        (("list", "--json"), lambda doc: doc["root"]),
        (("check-perms", "--json"), lambda doc: doc["root"]),
    ],
    ids=lambda a: a[0] if isinstance(a, tuple) else "",
)
def test_state_commands_read_the_clusters_install(site: Site, capsys, argv, shows_root):
    code, out, err = run_cli(capsys, *argv, "--cluster", "box")
    assert code in (0, 1), err  # check-perms exits 1 on problems; the root is what counts
    assert shows_root(json.loads(out)) == str(site.box)


def test_setup_perms_targets_the_clusters_tree(site: Site, capsys):
    # The case: a config root must not make a maintainer fix another tree.
    code, out, err = run_cli(capsys, "setup-perms", "--cluster", "box", "--group", "nogroup")
    assert code == 0, err
    assert out.startswith(f"# setup-perms for {site.box} ")
    assert str(site.config) not in out and str(site.env) not in out


def test_init_creates_the_clusters_root_not_the_defaults(site: Site, capsys, tmp_path):
    fresh = tmp_path / "new-box-root"
    (tmp_path / "clusters.toml").write_text(f'[clusters.newbox]\nroot = "{fresh}"\n')
    code, out, err = run_cli(capsys, "init", "--cluster", "newbox", "--yes", "--json")
    assert code == 0, err
    assert json.loads(out)["root"] == str(fresh)
    assert (fresh / "layout.json").is_file()


def test_init_records_an_unregistered_cluster(capsys, tmp_path, monkeypatch):
    # init is how a new machine is named, so an unknown name is no error there.
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "config.toml"))
    root = tmp_path / "root"
    code, _, err = run_cli(capsys, "init", "--root", root, "--cluster", "brandnew", "--yes")
    assert code == 0, err
    assert resolve_layout(root, cluster="brandnew").root == root


# --- the calculator -------------------------------------------------------------


def test_calculator_cluster_beats_env_and_config(site: Site):
    calc = RootstockCalculator(cluster="box", checkpoint="emt", device="cpu")
    assert calc.spec.layout.root == site.box
    assert calc.worker_pid is None
    calc.close()


def test_calculator_refuses_an_unknown_cluster(site: Site):
    with pytest.raises(UsageError, match=r"unknown cluster 'boxx'; known clusters: .*box"):
        RootstockCalculator(root=site.config, cluster="boxx", checkpoint="emt")
    with pytest.raises(UsageError, match="unknown cluster 'boxx'"):
        RootstockCalculator(cluster="boxx", checkpoint="emt")


def test_calculator_accepts_a_cluster_the_manifest_names(site: Site):
    calc = RootstockCalculator(root=site.config, cluster="shared", checkpoint="emt")
    assert calc.spec.layout.root == site.config and calc.spec.cluster == "shared"
    calc.close()
