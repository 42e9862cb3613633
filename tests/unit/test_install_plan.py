"""``rootstock install --dry-run``: the plan, its JSON shape, and that it builds nothing.

Every test runs the CLI in-process with uv made unreachable (no ``uv`` package
binary, an empty PATH, and ``subprocess`` refusing to start anything), so a dry run
that tried to lock or build would fail loudly instead of quietly building.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.install.envfile import read_env_file
from rootstock.ops.init import InitRequest, init_root

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
AURORA = REPO / "aurora_configs"
AURORA_FILES = sorted(AURORA.glob("*.py"))
ENVIRONMENTS = REPO / "environments"
MALFORMED = REPO / "tests" / "envs" / "malformed"

PLAN_KEYS = {"dry_run", "ok", "root", "root_exists", "cache_root", "cluster", "notes", "envs"}
ENV_KEYS = {
    "name",
    "path",
    "action",
    "reason",
    "requires_python",
    "dependencies",
    "checkpoints",
    "clusters",
    "tool_uv",
    "source_hash",
    "resolution",
    "lockfile",
    "interpreter",
    "shadows",
    "problems",
    "warnings",
}
PROBLEM_KEYS = {"path", "line", "message", "fix"}


@pytest.fixture(autouse=True)
def no_uv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private config, no uv anywhere, and no subprocess of any kind."""
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "user" / "config.toml"))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))

    def refuse(*args, **kwargs):
        raise AssertionError(f"a dry run started a process: {args!r}")

    import uv

    monkeypatch.setattr(uv, "find_uv_bin", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def fake_install(root: Path, env_file: Path, name: str | None = None) -> None:
    """Register ``env_file`` and make it look built (env_source.py is what counts)."""
    name = name or env_file.stem
    env_dir = root / "envs" / name
    env_dir.mkdir(parents=True)
    shutil.copyfile(env_file, env_dir / "env_source.py")
    shutil.copyfile(env_file, root / "environments" / f"{name}.py")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An initialised root on which the universal mace env is installed."""
    path = tmp_path / "root"
    init_root(InitRequest(root=path, cluster="aurora"))
    fake_install(path, ENVIRONMENTS / "mace.py")
    return path


def dry_run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["install", "--dry-run", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def dry_run_json(capsys, *args: str) -> tuple[int, dict]:
    code, out, _ = dry_run(capsys, *args, "--json")
    return code, json.loads(out)


# --- the aurora_configs files ---------------------------------------------------


def test_there_are_xpu_variants_of_mace_uma_and_more():
    names = {p.stem for p in AURORA_FILES}
    assert {"mace-xpu", "uma-xpu"} <= names
    assert len(names) >= 3


@pytest.mark.parametrize("path", AURORA_FILES, ids=lambda p: p.name)
def test_aurora_file_is_an_xpu_variant_for_aurora(path: Path):
    env = read_env_file(path)
    assert env.clusters == ["aurora"]
    # The env name must not clash with the universal env's, which stays installed.
    assert not (ENVIRONMENTS / path.name).exists()
    tool_uv = env.script_metadata["tool"]["uv"]
    indexes = {i["name"]: i for i in tool_uv["index"]}
    assert indexes["pytorch-xpu"]["url"] == "https://download.pytorch.org/whl/xpu"
    assert indexes["pytorch-xpu"]["explicit"] is True
    assert tool_uv["sources"]["torch"] == {"index": "pytorch-xpu"}
    assert any(d.split(">")[0].split("=")[0].strip() == "torch" for d in env.dependencies)
    tree = ast.parse(env.source)
    setup = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "setup")
    defaults = dict(
        zip(
            [a.arg for a in setup.args.args][-len(setup.args.defaults) :],
            setup.args.defaults,
            strict=True,
        )
    )
    assert ast.literal_eval(defaults["device"]) == "xpu"


def test_dry_run_accepts_every_aurora_file_and_writes_nothing(capsys, root: Path):
    before = snapshot(root)
    code, plan = dry_run_json(capsys, AURORA, "--root", root)
    assert code == 0, plan
    assert plan["ok"] is True
    assert [e["name"] for e in plan["envs"]] == [p.stem for p in AURORA_FILES]
    for env in plan["envs"]:
        assert env["action"] == "build"
        assert env["clusters"] == ["aurora"]
        assert env["problems"] == []
        assert env["tool_uv"]["sources"]["torch"] == {"index": "pytorch-xpu"}
    mace = next(e for e in plan["envs"] if e["name"] == "mace-xpu")
    # A variant may redeclare the universal env's ids: reported, not refused.
    shadowed = {s["checkpoint"] for s in mace["shadows"] if s["env"] == "mace"}
    assert "mace-mp-0-medium" in shadowed
    assert snapshot(root) == before
    assert not (root / ".build").exists()


def test_text_output_shows_what_would_be_built(capsys, root: Path):
    code, out, err = dry_run(capsys, AURORA / "mace-xpu.py", "--root", root)
    assert code == 0, err
    assert "dry run: nothing is built or written" in out
    assert "mace-xpu: would build" in out
    assert "uv index         pytorch-xpu = https://download.pytorch.org/whl/xpu (explicit)" in out
    assert "uv source        torch <- index pytorch-xpu" in out
    assert "clusters         aurora" in out
    assert "shadows" in out and "of 'mace'" in out
    assert out.rstrip().endswith("plan: 1 build")


# --- the JSON shape -----------------------------------------------------------------


def test_json_shape_is_pinned(capsys, root: Path):
    code, plan = dry_run_json(capsys, MALFORMED / "no-setup.py", "--root", root)
    assert code == 1
    assert set(plan) == PLAN_KEYS
    assert plan["dry_run"] is True and plan["ok"] is False
    assert plan["root"] == str(root) and plan["root_exists"] is True
    assert plan["cache_root"] == str(root)
    (env,) = plan["envs"]
    assert set(env) == ENV_KEYS
    assert env["action"] == "blocked"
    assert env["problems"] and all(set(p) == PROBLEM_KEYS for p in env["problems"])
    assert any("setup()" in p["message"] for p in env["problems"])


def test_a_lint_warning_is_shown_and_never_blocks(capsys, root: Path, tmp_path: Path):
    path = tmp_path / "toy.py"
    source = (ENVIRONMENTS / "emt.py").read_text()
    path.write_text(
        source.replace('"licence": "LGPL', '"licence_url": "x",\n        "licence": "LGPL')
    )
    code, plan = dry_run_json(capsys, path, "--root", root)
    assert code == 0
    (env,) = plan["envs"]
    assert (env["action"], env["problems"]) == ("build", [])
    (warning,) = env["warnings"]
    assert set(warning) == PROBLEM_KEYS
    assert "unknown field 'licence_url'" in warning["message"]
    code, _out, err = dry_run(capsys, path, "--root", root)
    assert code == 0
    assert f"warning: toy: {path}:" in err and "unknown field 'licence_url'" in err

    # The real install says it too, even when there is nothing to build (no uv runs).
    fake_install(root, path)
    code = main(["install", str(path), "--root", str(root), "--no-perm-check", "--no-push"])
    _out, err = capsys.readouterr()
    assert code == 0
    assert f"warning: toy: {path}:" in err and "unknown field 'licence_url'" in err
    assert main(["install", str(path), "--root", str(root), "--no-perm-check", "--json"]) == 0
    (outcome,) = json.loads(capsys.readouterr().out)
    assert outcome["status"] == "unchanged"
    assert len(outcome["warnings"]) == 1 and "licence_url" in outcome["warnings"][0]


# --- failures -----------------------------------------------------------------------


def test_malformed_file_exits_1_with_lint_lines(capsys, root: Path):
    path = MALFORMED / "no-setup.py"
    before = snapshot(root)
    code, out, err = dry_run(capsys, path, "--root", root)
    assert code == 1
    assert f"error: no-setup: {path}:1: no top-level setup() function (fix: define" in err
    assert "no-setup: would fail" in out
    assert snapshot(root) == before


def test_a_malformed_file_in_a_directory_does_not_hide_the_others(capsys, root, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copyfile(AURORA / "uma-xpu.py", folder / "uma-xpu.py")
    shutil.copyfile(MALFORMED / "syntax-error.py", folder / "syntax-error.py")
    code, plan = dry_run_json(capsys, folder, "--root", root)
    assert code == 1
    actions = {e["name"]: e["action"] for e in plan["envs"]}
    assert actions == {"syntax-error": "blocked", "uma-xpu": "build"}


def test_id_conflict_with_an_installed_env_is_reported(capsys, root: Path):
    fake_install(root, ENVIRONMENTS / "emt.py")
    code, plan = dry_run_json(capsys, MALFORMED / "duplicate-id-of-emt.py", "--root", root)
    assert code == 1
    (env,) = plan["envs"]
    assert env["action"] == "blocked"
    assert any(
        "already declared by the installed env 'emt'" in p["message"] for p in env["problems"]
    )


def test_ids_clash_between_files_of_one_run(capsys, root: Path, tmp_path: Path):
    folder = tmp_path / "two"
    folder.mkdir()
    shutil.copyfile(AURORA / "uma-xpu.py", folder / "a.py")
    shutil.copyfile(AURORA / "uma-xpu.py", folder / "b.py")
    code, plan = dry_run_json(capsys, folder, "--root", root)
    assert code == 1
    assert [e["action"] for e in plan["envs"]] == ["build", "blocked"]
    assert "variant 'a' for cluster(s) aurora" in plan["envs"][1]["problems"][0]["message"]


# --- installed envs: unchanged, rebuild, changed source -------------------------------


def test_installed_env_is_unchanged_then_rebuilt_with_force(capsys, root: Path):
    (root / "environments" / "mace.py.lock").write_text("lock")
    code, plan = dry_run_json(capsys, ENVIRONMENTS / "mace.py", "--root", root)
    assert code == 0
    assert plan["envs"][0]["action"] == "unchanged"
    # A registered env can be named, as with the real install.
    code, plan = dry_run_json(capsys, "mace", "--force", "--root", root)
    assert code == 0
    env = plan["envs"][0]
    assert env["action"] == "rebuild"
    assert env["resolution"] == "lockfile"
    assert env["lockfile"] == str(root / "environments" / "mace.py.lock")
    code, plan = dry_run_json(capsys, "mace", "--upgrade", "--root", root)
    assert plan["envs"][0]["resolution"] == "upgrade"


def test_changed_source_without_force_is_blocked(capsys, root: Path, tmp_path: Path):
    edited = tmp_path / "mace.py"
    edited.write_text((ENVIRONMENTS / "mace.py").read_text() + "\n# edited\n")
    code, plan = dry_run_json(capsys, edited, "--root", root)
    assert code == 1
    assert plan["envs"][0]["action"] == "blocked"
    assert "--force" in plan["envs"][0]["problems"][0]["fix"]


# --- roots that are not there ---------------------------------------------------------


def test_missing_root_is_a_note_and_is_not_created(capsys, tmp_path: Path):
    missing = tmp_path / "not-yet"
    code, plan = dry_run_json(capsys, AURORA, "--root", missing)
    assert code == 0
    assert plan["root_exists"] is False
    assert any("does not exist yet" in n for n in plan["notes"])
    assert not missing.exists()


def test_no_root_at_all_lints_only(capsys, tmp_path: Path):
    code, plan = dry_run_json(capsys, AURORA)
    assert code == 0
    assert plan["root"] is None
    assert any("only the lint ran" in n for n in plan["notes"])
    assert not (tmp_path / "user" / "config.toml").exists()


def test_env_name_without_a_root_is_an_error(capsys):
    code, _, err = dry_run(capsys, "mace")
    assert code == 1
    assert "no install root is given" in err
