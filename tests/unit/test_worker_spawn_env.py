"""The worker's environment and its private socket directory (no processes)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import threading
from pathlib import Path

import pytest

from rootstock.errors import WorkerTimeout
from rootstock.install.layout import InstallLayout
from rootstock.runtime import server, spawn, worker_env
from rootstock.runtime.spec import WorkerSpec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    return InstallLayout(tmp_path / "root", tmp_path / "cache-root")


@pytest.fixture
def user(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return {
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": "/somewhere/else",
        "PYTHONHOME": "/elsewhere",
        "PYTHONPYCACHEPREFIX": "/tmp/pycache",
        "XDG_CACHE_HOME": str(tmp_path / "xdg-cache"),
    }


def test_redirects_home_and_caches_into_the_cache_root(layout, user):
    env = worker_env.worker_environment(layout, "emt", base=user)
    assert env["HOME"] == str(layout.cache_root / "home")
    assert env["XDG_CACHE_HOME"] == str(layout.cache_root / "cache")
    assert env["HF_HOME"] == str(layout.cache_root / "cache" / "huggingface")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONNOUSERSITE"] == "1"
    assert env["VIRTUAL_ENV"] == str(layout.env_dir("emt"))
    assert env["PATH"].split(os.pathsep)[0] == str(layout.env_dir("emt") / "bin")
    for var in ("PYTHONPATH", "PYTHONHOME", "PYTHONPYCACHEPREFIX"):
        assert var not in env


def test_download_phase_is_not_forced_offline(layout, user):
    env = worker_env.worker_environment(layout, "emt", offline=False, base=user)
    assert "HF_HUB_OFFLINE" not in env


def test_compiler_caches_are_per_user_and_outside_the_roots(layout, user):
    env = worker_env.worker_environment(layout, "emt", base=user)
    for var in worker_env.COMPILER_CACHE_VARS:
        path = Path(env[var])
        assert path.is_relative_to(Path(user["XDG_CACHE_HOME"]) / "rootstock"), var
        assert not path.is_relative_to(layout.root)
        assert not path.is_relative_to(layout.cache_root)


def test_compiler_cache_inside_the_shared_root_falls_back(layout, user):
    # A caller whose cache dir already points into the install (e.g. a nested spawn).
    user["XDG_CACHE_HOME"] = str(layout.cache_root / "cache")
    chosen = worker_env.compiler_cache_dir(user, layout)
    assert not chosen.is_relative_to(layout.cache_root)
    assert stat.S_IMODE(chosen.stat().st_mode) & 0o077 == 0


def test_user_set_compiler_cache_is_kept(layout, user):
    user["TRITON_CACHE_DIR"] = "/my/triton"
    env = worker_env.worker_environment(layout, "emt", base=user)
    assert env["TRITON_CACHE_DIR"] == "/my/triton"


def test_hf_token_lookup_order(tmp_path, user):
    home = Path(user["HOME"])
    assert worker_env.find_hf_token(user, home) == (None, None)
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_cache\n")
    assert worker_env.find_hf_token(user, home)[0] == "hf_cache"
    (home / ".hf_token").write_text("  hf_dot  \n")
    assert worker_env.find_hf_token(user, home)[0] == "hf_dot"
    token_file = tmp_path / "token-file"
    token_file.write_text("hf_file")
    user["HF_TOKEN_FILE"] = str(token_file)
    assert worker_env.find_hf_token(user, home) == ("hf_file", str(token_file))
    user["HF_TOKEN"] = "hf_env"
    assert worker_env.find_hf_token(user, home) == ("hf_env", "HF_TOKEN")


def test_empty_or_unreadable_token_files_are_skipped(tmp_path, user):
    home = Path(user["HOME"])
    user["HF_TOKEN_FILE"] = str(tmp_path / "missing")
    (home / ".hf_token").write_text("   \n")
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_last")
    assert worker_env.find_hf_token(user, home)[0] == "hf_last"


def test_token_is_exported_under_both_names(layout, user):
    (Path(user["HOME"]) / ".hf_token").write_text("hf_secret\n")
    env = worker_env.worker_environment(layout, "emt", base=user)
    assert env["HF_TOKEN"] == env["HUGGING_FACE_HUB_TOKEN"] == "hf_secret"


def test_worker_command_uses_the_env_python_isolated(layout):
    spec = WorkerSpec(layout, "emt", "emt", device="cpu", setup_kwargs={"a": 1})
    argv = spawn.worker_command(spec, socket_path="/s", mode="calculator")
    assert argv[0] == str(layout.env_python("emt"))
    assert argv[1:7] == ["-I", "-u", "-X", "faulthandler", "-m", "rootstock.worker"]
    assert argv[argv.index("--kwargs") + 1] == '{"a": 1}'


def test_worker_command_carries_every_field_of_the_spec(layout, tmp_path):
    spec = WorkerSpec(layout, "mace:custom", "mace", device="cuda:1", weights=tmp_path / "my.model")
    argv = spawn.worker_command(
        spec, socket_path="/s", mode="serve", structure=tmp_path / "x.xyz", connect_timeout=5.0
    )

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--env-source") == str(layout.env_source("mace"))
    assert value("--checkpoint") == "mace:custom"
    assert value("--device") == "cuda:1"
    assert value("--kwargs") == "{}"
    assert value("--weights") == str(tmp_path / "my.model")
    assert value("--mode") == "serve"
    assert value("--structure") == str(tmp_path / "x.xyz")
    assert value("--connect-timeout") == "5.0"
    assert "--debug" not in argv


# --- private socket directory ----------------------------------------------------------


def test_private_dir_is_fresh_0700_and_not_directly_in_tmp(monkeypatch, short_tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_tmp_path))
    first, second = server.make_private_dir(), server.make_private_dir()
    assert first != second
    assert first.parent == short_tmp_path
    assert stat.S_IMODE(first.stat().st_mode) == 0o700


def test_long_base_dirs_fall_back_to_a_short_private_dir(monkeypatch, tmp_path):
    deep = tmp_path / ("x" * 90)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    run_dir = server.make_private_dir()
    try:
        assert run_dir.parent == Path("/tmp")
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(run_dir)  # it holds its owner record


def test_listener_accepts_one_connection_and_cleans_up():
    listener = server.WorkerListener()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    threading.Timer(0.05, client.connect, args=(str(listener.path),)).start()
    conn = listener.accept(timeout=5)
    assert not listener.path.exists()  # one worker per listener
    conn.close()
    client.close()
    listener.cleanup()
    assert not listener.run_dir.exists()


def test_accept_checks_liveness_and_times_out():
    listener = server.WorkerListener()
    calls = []
    try:
        with pytest.raises(WorkerTimeout):
            listener.accept(timeout=0.3, on_wait=lambda: calls.append(1))
        assert calls
    finally:
        listener.cleanup()
