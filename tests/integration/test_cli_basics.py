"""The CLI's contract as a user meets it, in a subprocess each: help, error messages,
exit codes, new-env, resolve --json.

Moved from tests/unit (which starts no subprocess); the in-process part stays there.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rootstock.cli.main import COMMANDS
from rootstock.install.envfile import read_env_file
from tests.conftest import run_rootstock

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("private_config")]


def test_help_lists_commands_without_heavy_imports():
    script = (
        "import io, json, sys, contextlib\n"
        "from rootstock.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    code = main(['--help'])\n"
        "heavy = {m: m in sys.modules for m in ('rich', 'numpy', 'ase')}\n"
        "print(json.dumps({'code': code, 'heavy': heavy, 'help': out.getvalue()}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    doc = json.loads(proc.stdout)
    assert doc["code"] == 0
    assert doc["heavy"] == {"rich": False, "numpy": False, "ase": False}
    for name in COMMANDS:
        assert f"  {name}" in doc["help"], name
    assert "--debug" in doc["help"]


def test_help_exits_zero():
    proc = run_rootstock("--help", timeout=60)
    assert "Commands:" in proc.stdout
    assert run_rootstock("init", "--help", timeout=60).stdout.startswith("Usage: rootstock init")


def test_version():
    assert run_rootstock("--version", timeout=60).stdout.startswith("rootstock ")


def test_error_prints_message_and_hint_without_traceback():
    proc = run_rootstock("status", "--root", "/nonexistent/rootstock", timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: install root /nonexistent/rootstock does not exist")
    assert "\n  hint: " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_filesystem_error_is_a_plain_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_rootstock(
        "init", "--root", blocker / "root", "--cluster", "x", "--yes", timeout=60, check=False
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ")
    assert "--debug" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_debug_shows_the_traceback():
    proc = run_rootstock(
        "--debug", "status", "--root", "/nonexistent/rootstock", timeout=60, check=False
    )
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert "RootNotFound" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [("status", "--no-such-option"), ("no-such-command",), ("new-env",), ("init", "--force=3")],
    ids=["unknown-option", "unknown-command", "missing-argument", "flag-with-value"],
)
def test_usage_errors_exit_2(args):
    proc = run_rootstock(*args, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Usage:" in proc.stderr or "Error:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_invalid_env_name_is_a_usage_error(tmp_path):
    proc = run_rootstock("new-env", "bad name!", "-o", tmp_path / "x.py", timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: 'bad name!' is not a valid env name")
    assert not (tmp_path / "x.py").exists()


# --- new-env ------------------------------------------------------------------------


def test_new_env_template_passes_the_lint(tmp_path):
    path = tmp_path / "mymodel.py"
    proc = run_rootstock("new-env", "mymodel", "-o", path, timeout=60)
    assert f"wrote {path}" in proc.stdout
    env = read_env_file(path, "mymodel")
    assert "mymodel-small" in env.checkpoints


def test_new_env_defaults_to_name_in_cwd(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "rootstock.cli.main", "new-env", "foo"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=True,
    )
    read_env_file(tmp_path / "foo.py", "foo")


def test_new_env_refuses_to_overwrite_unless_forced(tmp_path):
    path = tmp_path / "mymodel.py"
    path.write_text("# precious\n")
    proc = run_rootstock("new-env", "mymodel", "-o", path, timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: {path} already exists")
    assert "--force" in proc.stderr
    assert path.read_text() == "# precious\n"

    run_rootstock("new-env", "mymodel", "-o", path, "--force", timeout=60)
    assert "mymodel-small" in read_env_file(path, "mymodel").checkpoints


# --- resolve --json ------------------------------------------------------------------

RESOLVE_KEYS = {
    "root",
    "root_source",
    "root_exists",
    "shadowed",
    "cache_root",
    "cache_root_source",
    "layout_version",
    "cluster",
    "siblings",
}


def test_resolve_json_shape_for_an_initialised_root(tmp_path):
    root, cache = tmp_path / "root", tmp_path / "cache"
    run_rootstock("init", "--root", root, "--cache-root", cache, "--cluster", "b", timeout=60)
    clusters = tmp_path / "clusters.toml"
    clusters.write_text(f'[clusters.a]\nroot = "{root}"\n[clusters.b]\nroot = "{root}"\n')
    proc = run_rootstock(
        "resolve", "--cluster", "a", "--json",
        env={"ROOTSTOCK_CLUSTERS_FILE": str(clusters)}, timeout=60,
    )  # fmt: skip
    doc = json.loads(proc.stdout)
    assert set(doc) == RESOLVE_KEYS
    assert doc == {
        "root": str(root),
        # --cluster comes before config.toml, which here names the same root
        "root_source": "cluster registry (a)",
        "root_exists": True,
        "shadowed": [],
        "cache_root": str(cache),
        "cache_root_source": "layout.json",
        "layout_version": 1,
        "cluster": "a",
        "siblings": ["a", "b"],
    }


def test_resolve_json_for_a_registered_cluster_not_yet_initialised():
    doc = json.loads(run_rootstock("resolve", "--cluster", "polaris", "--json", timeout=60).stdout)
    assert set(doc) == RESOLVE_KEYS
    assert doc["root_source"] == "cluster registry (polaris)"
    assert doc["root_exists"] is False
    assert doc["layout_version"] is None
    assert doc["cache_root"] == doc["root"]
    assert doc["siblings"] == ["polaris", "sophia"]


def test_resolve_text_output(tmp_path):
    proc = run_rootstock("resolve", "--root", tmp_path / "nowhere", timeout=60)
    assert "(from --root)" in proc.stdout
    assert "does not exist yet" in proc.stdout


def test_resolve_unknown_cluster_fails_cleanly():
    proc = run_rootstock("resolve", "--cluster", "nosuchbox", timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown cluster 'nosuchbox'; known clusters: ")


def test_command_exit_code_reaches_the_shell(tmp_path):
    # install of a directory keeps going past failures, then exits 1 (click's Exit).
    root = tmp_path / "root"
    run_rootstock("init", "--root", root, "--cluster", "testbox", timeout=60)
    envs = tmp_path / "envs"
    envs.mkdir()
    (envs / "bad1.py").write_text("x = (\n")
    (envs / "bad2.py").write_text("y = (\n")
    proc = run_rootstock("install", envs, "--root", root, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "error: bad1:" in proc.stderr and "error: bad2:" in proc.stderr
    assert "Traceback" not in proc.stderr
