"""layout.json, config.toml and the cluster registry refuse bad input cleanly (issue #13).

Every corrupt variant below is a clean :class:`RootstockError` naming the file
(and the field), never another exception; the file stays byte-identical; and
the CLI, run in-process through ``rootstock.cli.main.main``, exits non-zero with
an ``error:`` line and no traceback. ``RootstockCalculator`` refuses the same
files at construction, before any worker could be spawned.

The installs are real (``init_root``); the one ``emt`` env is a FAKE (its
``env_source.py`` copied into ``envs/emt/``, no interpreter), which is all that
construction-time resolution reads. Nothing here starts a process.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.errors import ConfigError, LayoutError, UsageError
from rootstock.install.clusters import load_registry
from rootstock.install.config import load_config, save_config
from rootstock.install.layout import read_layout, write_layout
from rootstock.install.machine import resolve_cache_root, resolve_layout, resolve_root
from rootstock.names import StoredNameWarning
from rootstock.ops.init import InitRequest, init_root
from rootstock.runtime.calculator import RootstockCalculator

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SAMPLE_EMT = REPO / "environments" / "emt.py"

DEEP_JSON = b"[" * 100_000 + b"]" * 100_000
DEEP_TOML = b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n"

# id -> (layout.json bytes, a word the message must hold besides the path)
LAYOUT_CASES = {
    "not-json": (b"{not json", "invalid JSON"),
    "empty": (b"", "invalid JSON"),
    "array": (b"[1, 2]", "object"),
    "no-version": (b'{"cache_root": null}', "layout_version"),
    "version-string": (b'{"layout_version": "1", "cache_root": null}', "layout_version"),
    "version-true": (b'{"layout_version": true, "cache_root": null}', "layout_version"),
    "version-float": (b'{"layout_version": 1.0, "cache_root": null}', "layout_version"),
    "version-negative": (b'{"layout_version": -1, "cache_root": null}', "layout_version"),
    "version-99": (b'{"layout_version": 99, "cache_root": null}', "layout version 99"),
    "cache-root-number": (b'{"layout_version": 1, "cache_root": 5}', "cache_root"),
    "cache-root-relative": (b'{"layout_version": 1, "cache_root": "rel/dir"}', "cache_root"),
    "cache-root-home": (b'{"layout_version": 1, "cache_root": "~/cache"}', "cache_root"),
    "cache-root-empty": (b'{"layout_version": 1, "cache_root": ""}', "cache_root"),
    "cache-root-nul": (b'{"layout_version": 1, "cache_root": "/a\\u0000b"}', "NUL"),
    "cache-root-list": (b'{"layout_version": 1, "cache_root": []}', "cache_root"),
    "cache-root-bool": (b'{"layout_version": 1, "cache_root": false}', "cache_root"),
    "cache-root-object": (b'{"layout_version": 1, "cache_root": {"a": 1}}', "cache_root"),
    "deep": (DEEP_JSON, "nested deeper"),
    "nan": (b'{"layout_version": 1, "cache_root": null, "x": NaN}', "NaN"),
    "infinity": (b'{"layout_version": 1, "cache_root": null, "x": 1e999}', "out of range"),
    "not-utf8": ('{"layout_version": 1, "cache_root": "/caf\xe9"}'.encode("latin-1"), "UTF-8"),
    "huge-integer": (b'{"layout_version": ' + b"1" * 5000 + b"}", "too many digits"),
}

# id -> (config.toml bytes, the key the message must name, or a word it must hold)
CONFIG_CASES = {
    "not-utf8": ('root = "/caf\xe9"\n'.encode("latin-1"), "UTF-8"),
    "invalid-toml": (b"root = \n", "invalid TOML"),
    "deep": (DEEP_TOML, "nested deeper"),
    "root-number": (b"root = 5\n", "root"),
    "root-empty": (b'root = ""\n', "root"),
    "root-array": (b'root = ["/a", "/b"]\n', "root"),
    "root-relative": (b'root = "rel/dir"\n', "root"),
    "root-nul": (b'root = "/a\\u0000b"\n', "NUL"),
    "root-table": (b"[root]\npath = '/a'\n", "root"),
    "is-maintainer-yes": (b'is_maintainer = "yes"\n', "is_maintainer"),
    "is-maintainer-1": (b"is_maintainer = 1\n", "is_maintainer"),
    "api-url-number": (b"api_url = 5\n", "api_url"),
    "api-key-array": (b'api_key = ["a"]\n', "api_key"),
    "maintainer-name-bool": (b"maintainer_name = true\n", "maintainer_name"),
    "cluster-number": (b"cluster = 5\n", "cluster"),
    "huge-integer": (b"push_timeout = " + b"1" * 5000 + b"\n", "too many digits"),
}

# id -> (registry bytes, the word the message must hold besides the path)
REGISTRY_CASES = {
    "not-utf8": ('[clusters.x]\nroot = "/caf\xe9"\n'.encode("latin-1"), "UTF-8"),
    "deep": (DEEP_TOML, "nested deeper"),
    "root-relative": (b'[clusters.x]\nroot = "rel"\n', "root"),
    "root-home": (b'[clusters.x]\nroot = "~/rootstock"\n', "root"),
    "root-empty": (b'[clusters.x]\nroot = ""\n', "root"),
    "root-nul": (b'[clusters.x]\nroot = "/a\\u0000b"\n', "NUL"),
    "root-array": (b'[clusters.x]\nroot = ["/a"]\n', "root"),
    "cache-root-number": (b'[clusters.x]\nroot = "/r"\ncache_root = 5\n', "cache_root"),
    "cache-root-relative": (b'[clusters.x]\nroot = "/r"\ncache_root = "c"\n', "cache_root"),
    "same-name-twice": (b'[clusters.Box]\nroot = "/a"\n[clusters.box]\nroot = "/b"\n', "'box'"),
    "huge-integer": (b'[clusters.x]\nroot = "/r"\nn = ' + b"1" * 5000 + b"\n", "too many digits"),
}


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private config.toml path (no file yet); no root or registry from the environment."""
    config = tmp_path / "user" / "config.toml"
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(config))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    return config


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


def make_install(root: Path) -> Path:
    """A real initialised root with a FAKE emt env (an env_source.py, no interpreter)."""
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


def assert_clean_refusal(code: int, err: str) -> None:
    assert code in (1, 2), err
    assert err.startswith("error: "), err
    assert "\n  hint: " in err, err
    assert "Traceback" not in err, err


def child_pids() -> set[str]:
    """This process's direct children (Linux), to show that nothing was spawned."""
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return set(path.read_text().split()) if path.exists() else set()


# --- layout.json ---------------------------------------------------------------------


@pytest.fixture
def install(tmp_path: Path) -> Path:
    return make_install(tmp_path / "root")


@pytest.mark.parametrize("variant", LAYOUT_CASES)
def test_bad_layout_is_a_layout_error_and_stays_untouched(install: Path, variant: str):
    raw, word = LAYOUT_CASES[variant]
    (install / "layout.json").write_bytes(raw)
    before = snapshot(install)
    for read in (read_layout, resolve_cache_root, resolve_layout):
        with pytest.raises(LayoutError) as info:
            read(install)
        assert str(install / "layout.json") in info.value.message
        assert word in info.value.message
        assert info.value.hint
    assert snapshot(install) == before


LAYOUT_COMMANDS = {
    "status": ("status", "--root", "{root}"),
    "status-json": ("status", "--json", "--root", "{root}"),
    "list": ("list", "--root", "{root}"),
    "resolve": ("resolve", "--root", "{root}"),
    "smoke-test": ("smoke-test", "--root", "{root}", "--device", "cpu", "--no-push"),
    "install-dry-run": ("install", "--dry-run", "--root", "{root}", SAMPLE_EMT),
    "add": ("add", "--root", "{root}", "emt", "--no-push"),
}


@pytest.mark.parametrize("command", LAYOUT_COMMANDS)
@pytest.mark.parametrize("variant", LAYOUT_CASES)
def test_bad_layout_is_refused_by_every_command(capsys, install: Path, variant, command):
    (install / "layout.json").write_bytes(LAYOUT_CASES[variant][0])
    before = snapshot(install)
    argv = [str(install) if a == "{root}" else a for a in LAYOUT_COMMANDS[command]]
    code, out, err = run_cli(capsys, *argv)
    assert_clean_refusal(code, err)
    assert out == ""
    assert code == 1
    first = err.splitlines()[0]
    assert first.startswith(f"error: {install / 'layout.json'}"), err
    assert LAYOUT_CASES[variant][1] in first
    assert snapshot(install) == before


def test_good_layout_lets_the_commands_run(capsys, install: Path):
    # The control for the refusals above: the same install with its own layout.json.
    code, out, err = run_cli(capsys, "status", "--json", "--root", install)
    assert code == 0, err
    assert json.loads(out)["cache_root"] == str(install)
    code, _out, err = run_cli(capsys, "resolve", "--root", install)
    assert code == 0, err


@pytest.mark.parametrize("variant", LAYOUT_CASES)
def test_calculator_refuses_bad_layout_before_any_worker(install: Path, variant: str):
    (install / "layout.json").write_bytes(LAYOUT_CASES[variant][0])
    before, children = snapshot(install), child_pids()
    with pytest.raises(LayoutError, match=r"layout\.json"):
        RootstockCalculator(checkpoint="emt", root=install, device="cpu")
    assert child_pids() == children
    assert snapshot(install) == before


def test_calculator_resolves_a_good_layout(install: Path):
    calc = RootstockCalculator(checkpoint="emt", root=install, device="cpu")
    assert calc.spec.layout.cache_root == install
    calc.close()


@pytest.mark.parametrize("version", [0, 1])
def test_layout_versions_up_to_this_one_are_read(tmp_path: Path, version: int):
    (tmp_path / "layout.json").write_text(f'{{"layout_version": {version}, "cache_root": null}}')
    assert read_layout(tmp_path)["layout_version"] == version


def test_informational_layout_fields_are_not_checked(tmp_path: Path):
    # written_by / written_at are never read: a hand edit to them breaks nothing.
    (tmp_path / "layout.json").write_text(
        '{"layout_version": 1, "cache_root": "/scratch/c", "written_by": 5, '
        '"written_at": [], "later_field": {"x": 1}}'
    )
    assert resolve_cache_root(tmp_path) == Path("/scratch/c")


@pytest.mark.parametrize("cache_root", ["rel/dir", "", "~/cache", "/a\0b", Path("rel")])
def test_write_layout_refuses_what_read_layout_would(tmp_path: Path, cache_root):
    with pytest.raises(LayoutError, match="cache_root"):
        write_layout(tmp_path, cache_root)
    assert not (tmp_path / "layout.json").exists()
    write_layout(tmp_path, tmp_path / "cache")
    before = snapshot(tmp_path)
    with pytest.raises(LayoutError):
        write_layout(tmp_path, cache_root)
    assert snapshot(tmp_path) == before


def test_cache_root_override_with_nul_is_a_usage_error(tmp_path: Path):
    with pytest.raises(UsageError, match="NUL"):
        resolve_cache_root(tmp_path, "/scratch/a\0b")


# --- config.toml ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", CONFIG_CASES)
def test_bad_config_is_a_config_error_and_stays_untouched(isolated: Path, variant: str):
    raw, word = CONFIG_CASES[variant]
    isolated.parent.mkdir(parents=True)
    isolated.write_bytes(raw)
    with pytest.raises(ConfigError) as info:
        load_config()
    assert str(isolated) in info.value.message
    assert word in info.value.message
    assert info.value.hint
    with pytest.raises(ConfigError):
        resolve_root()
    assert isolated.read_bytes() == raw
    assert os.listdir(isolated.parent) == ["config.toml"]


CONFIG_COMMANDS = {
    "resolve": ("resolve",),
    "status": ("status",),
    "list": ("list",),
    "init": ("init", "--root", "{new}", "--cluster", "box", "--yes"),
}


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
@pytest.mark.parametrize("variant", CONFIG_CASES)
def test_bad_config_is_refused_by_the_commands(capsys, tmp_path, isolated, variant, command):
    raw = CONFIG_CASES[variant][0]
    isolated.parent.mkdir(parents=True)
    isolated.write_bytes(raw)
    new = tmp_path / "new-root"
    argv = [str(new) if a == "{new}" else a for a in CONFIG_COMMANDS[command]]
    code, out, err = run_cli(capsys, *argv)
    assert_clean_refusal(code, err)
    assert out == ""
    assert code == 1
    first = err.splitlines()[0]
    assert first.startswith(f"error: {isolated}"), err  # this file's error, not another
    assert CONFIG_CASES[variant][1] in first
    assert isolated.read_bytes() == raw
    assert not new.exists()  # init refused before creating anything


def test_calculator_refuses_a_bad_config_root(isolated: Path):
    isolated.parent.mkdir(parents=True)
    isolated.write_text("root = 5\n")
    children = child_pids()
    with pytest.raises(ConfigError, match="root"):
        RootstockCalculator(checkpoint="emt", device="cpu")
    assert child_pids() == children


def test_config_root_may_start_with_home(isolated: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    isolated.parent.mkdir(parents=True)
    isolated.write_text('root = "~/rootstock"\n')
    assert resolve_root() == tmp_path / "home" / "rootstock"


def test_good_config_reads_with_types_intact(isolated: Path):
    isolated.parent.mkdir(parents=True)
    isolated.write_text(
        'root = "/shared/rootstock"\ncluster = "Della"\nis_maintainer = true\n'
        'api_url = "https://d.example.org"\npush_timeout = 5\n'
    )
    assert load_config() == {
        "root": "/shared/rootstock",
        "cluster": "della",  # normalised, as every name is
        "is_maintainer": True,
        "api_url": "https://d.example.org",
        "push_timeout": 5,  # not ours to check: the push client does
    }


def test_stored_invalid_cluster_warns_with_the_fix_and_is_not_written_again(isolated: Path):
    isolated.parent.mkdir(parents=True)
    raw = b'root = "/shared/rootstock"\ncluster = "Bad Name!"\n'
    isolated.write_bytes(raw)
    with pytest.warns(StoredNameWarning, match=r"'Bad Name!'.*rootstock init --force"):
        config = load_config()
    assert config["cluster"] == "Bad Name!"  # the install stays usable
    with pytest.raises(UsageError, match="not a valid cluster name"):
        save_config(config)
    assert isolated.read_bytes() == raw
    assert os.listdir(isolated.parent) == ["config.toml"]


def test_init_replaces_a_stored_invalid_cluster(capsys, tmp_path: Path, isolated: Path):
    root = make_install(tmp_path / "root")
    isolated.write_text(f'root = "{root}"\ncluster = "Bad Name!"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoredNameWarning)
        code, _out, err = run_cli(capsys, "init", "--force", "--root", root, "--cluster", "box")
    assert code == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoredNameWarning)
        assert load_config()["cluster"] == "box"


@pytest.mark.parametrize(
    "values",
    [
        {"root": "rel/dir"},
        {"root": 5},
        {"is_maintainer": "yes"},
        {"api_url": 5},
        {"cluster": "Bad Name!"},
        {"cluster": 5},
    ],
    ids=[
        "root-relative",
        "root-number",
        "is-maintainer-text",
        "api-url-number",
        "cluster-bad",
        "cluster-number",
    ],
)
def test_save_config_refuses_what_load_config_would(isolated: Path, values):
    with pytest.raises(UsageError, match="refusing to write"):
        save_config(values)
    assert not isolated.exists()


def test_save_config_writes_any_text_so_it_reads_back(isolated: Path):
    # Control characters, quotes and keys that are not bare once made the file unreadable.
    values = {
        "root": "/shared/rootstock",
        "cluster": "box",
        "is_maintainer": False,
        "api_secret": 'a\r\x01\x7f"\\\tb\n',
        "a key": 1,
        "extra": {"list": [1, 2.5, "x"], "inner": {"b": True}},
    }
    save_config(values)
    assert load_config() == values


# --- the cluster registry ------------------------------------------------------------


def write_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raw: bytes) -> Path:
    path = tmp_path / "clusters.toml"
    path.write_bytes(raw)
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(path))
    return path


@pytest.mark.parametrize("variant", REGISTRY_CASES)
def test_bad_registry_is_a_config_error_and_stays_untouched(tmp_path, monkeypatch, variant):
    raw, word = REGISTRY_CASES[variant]
    path = write_registry(tmp_path, monkeypatch, raw)
    with pytest.raises(ConfigError) as info:
        load_registry()
    assert str(path) in info.value.message
    assert word in info.value.message
    assert info.value.hint
    assert path.read_bytes() == raw


@pytest.mark.parametrize("variant", REGISTRY_CASES)
def test_bad_registry_is_refused_by_the_commands(capsys, tmp_path, monkeypatch, variant):
    path = write_registry(tmp_path, monkeypatch, REGISTRY_CASES[variant][0])
    code, out, err = run_cli(capsys, "resolve", "--cluster", "della")
    assert_clean_refusal(code, err)
    assert out == ""
    assert str(path) in err.splitlines()[0]
    assert REGISTRY_CASES[variant][1] in err.splitlines()[0]


def test_registry_entry_with_an_invalid_name_is_skipped_with_a_warning(tmp_path, monkeypatch):
    write_registry(
        tmp_path,
        monkeypatch,
        b'[clusters."Bad Name!"]\nroot = "/a"\n[clusters.Good]\nroot = "/b"\ncache_root = "/c"\n',
    )
    with pytest.warns(StoredNameWarning, match=r"'Bad Name!'.*skipped"):
        registry = load_registry()
    assert "bad name!" not in registry and "Bad Name!" not in registry
    assert registry["good"].root == Path("/b")
    assert registry["good"].cache_root == Path("/c")


def test_registry_entry_without_cache_root_has_none(tmp_path, monkeypatch):
    write_registry(tmp_path, monkeypatch, b'[clusters.box]\nroot = "/shared/r"\n')
    assert load_registry()["box"].cache_root is None


def test_registry_cache_root_of_a_legacy_install_is_absolute(tmp_path, monkeypatch):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    write_registry(
        tmp_path,
        monkeypatch,
        f'[clusters.old]\nroot = "{legacy}"\ncache_root = "scratch"\n'.encode(),
    )
    with pytest.raises(ConfigError, match="cache_root"):
        resolve_cache_root(legacy)
    assert not (legacy / "layout.json").exists()
