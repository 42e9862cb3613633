"""Fixtures for the runtime tests: built roots, cluster registry, process teardown.

``fake_built_root`` (the name is historical) is a real root: every runtime test env is
built by real uv with ``rootstock install``, once per run (every pytest process of the
run uses the same root: :mod:`tests.run_cache`), sharing the run's uv cache.
``build_fake_root`` remains only for the two tests that need no working env at all (a
resolution error raised before any spawn, and a deliberately broken interpreter); it is
a FAKE: env_source.py plus a shell ``bin/python`` that execs the test runner's
interpreter.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rootstock.install.layout import write_layout
from rootstock.ops.workers import stop_workers
from rootstock.runtime.pool.directory import read_states
from tests.conftest import copy_env, copy_root, make_root, run_rootstock
from tests.integration.images import image_root, own_image_root, stage_dir  # noqa: F401
from tests.run_cache import shared_build

REPO = Path(__file__).resolve().parents[2]
TEST_ENVS = REPO / "tests" / "envs"
SAMPLE_EMT = REPO / "environments" / "emt.py"
TEST_CLUSTER = "testcluster"

# env name -> env file; the sample EMT env is the product's own file.
RUNTIME_ENVS = {
    "emt": SAMPLE_EMT,
    "emt-variant": TEST_ENVS / "emt_variant.py",
    "charge-emt": TEST_ENVS / "charge_emt.py",
    "noisy": TEST_ENVS / "noisy.py",
    "broken-setup": TEST_ENVS / "broken_setup.py",
    "custom-emt": TEST_ENVS / "custom_emt.py",
    "custom-no-hook": TEST_ENVS / "custom_no_hook.py",
    "probe": TEST_ENVS / "probe.py",
    "null": TEST_ENVS / "null_model.py",
    "batch-emt": TEST_ENVS / "batch_emt.py",
    "memory-emt": TEST_ENVS / "memory_emt.py",
    "count-emt": TEST_ENVS / "count_emt.py",
    "shifted-emt": TEST_ENVS / "shifted_emt.py",
}


def add_fake_env(root: Path, name: str, env_file: Path) -> Path:
    """Fake a built env: env_source.py plus a bin/python running the dev interpreter."""
    env_dir = root / "envs" / name
    (env_dir / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(env_file, env_dir / "env_source.py")
    python = env_dir / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return env_dir


def build_fake_root(root: Path, envs: dict[str, Path]) -> Path:
    """A root with layout.json, home/, cache/ and the given fake-built envs."""
    root.mkdir(parents=True, exist_ok=True)
    write_layout(root, None)
    (root / "home").mkdir(exist_ok=True)
    (root / "cache").mkdir(exist_ok=True)
    for name, env_file in envs.items():
        add_fake_env(root, name, env_file)
    return root


def install_real_root(root: Path, envs: dict[str, Path], uv_cache: Path) -> Path:
    """A root whose envs are built by real uv (one directory install).

    ``custom-no-hook`` cannot pass the install lint (a ``:custom`` id without
    setup_from_path), which is the point: it stands for a built env whose
    env_source.py lost the hook in a bad hotfix. It is made exactly that way, as a
    copy of the built EMT env with its env_source.py replaced.
    """
    make_root(root, uv_cache, cluster=TEST_CLUSTER)
    staging = root.parent / f"{root.name}-env-files"
    for name, env_file in envs.items():
        if name != "custom-no-hook":
            copy_env(env_file, staging, name)
    run_rootstock("install", staging, "--root", root, timeout=1800)
    if "custom-no-hook" in envs:
        source = (root / "envs" / "emt").resolve()
        target = root / "envs" / "custom-no-hook"
        subprocess.run(["cp", "-al", str(source), str(target)], check=True, timeout=300)
        (target / "env_source.py").unlink()  # a hard link: never write through it
        shutil.copyfile(envs["custom-no-hook"], target / "env_source.py")
    return root


def build_real_root(root: Path, envs: dict[str, Path], uv_cache: Path) -> Path:
    """A private root as :func:`install_real_root` makes it: a copy of one built that
    way once per run for the same env files (the build is not what such tests test)."""
    digest = hashlib.sha256(f"{uv_cache}\0".encode())
    for name, env_file in sorted(envs.items()):
        digest.update(name.encode() + b"\0" + env_file.read_bytes() + b"\0")
    template = shared_build(
        f"real-root-{digest.hexdigest()[:16]}",
        lambda path: install_real_root(path, envs, uv_cache),
    )
    return copy_root(template, root)


@pytest.fixture(scope="session")
def fake_built_root(shared_uv_cache: Path) -> Path:
    """A root with every runtime test env, built by real uv once per run; never modified."""
    return shared_build(
        "runtime-root", lambda root: install_real_root(root, RUNTIME_ENVS, shared_uv_cache)
    )


@pytest.fixture(scope="session")
def malformed_root(shared_uv_cache: Path) -> Path:
    """A root with the malformed-results test env (EMT broken on request), built once."""
    envs = {"malformed-results": TEST_ENVS / "malformed_results.py"}
    return shared_build(
        "malformed-root", lambda root: install_real_root(root, envs, shared_uv_cache)
    )


@pytest.fixture
def own_root(tmp_path: Path, shared_uv_cache: Path) -> Path:
    """A private real root for a test that edits envs (hotfixes)."""
    return build_real_root(tmp_path / "root", {"emt": SAMPLE_EMT}, shared_uv_cache)


@pytest.fixture
def runtime_isolation(monkeypatch, tmp_path_factory, fake_built_root: Path):
    """Private compiler caches, no user config, and a registry with the test cluster.

    Runtime test modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``.
    """
    private = tmp_path_factory.getbasetemp() / "runtime-isolation"
    private.mkdir(exist_ok=True)
    registry = private / "clusters.toml"
    registry.write_text(f'[clusters.{TEST_CLUSTER}]\nroot = "{fake_built_root}"\n')
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(registry))
    # Other tests run `rootstock init`, which records a root in the session config.
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(private / "no-config.toml"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "user-cache"))
    monkeypatch.delenv("ROOTSTOCK_WORKER_LOG", raising=False)
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)


@pytest.fixture
def pool_dir(monkeypatch):
    """A private runtime dir (short, so socket paths fit); every daemon in it is stopped."""
    runtime = Path(tempfile.mkdtemp(prefix="rs-pool-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("ROOTSTOCK_POOL", raising=False)
    pids: set[int] = set()

    def remember() -> None:
        for state in read_states(runtime / "rootstock"):
            pids.update(p for p in (state["daemon"]["pid"], state.get("worker_pid")) if p)

    yield runtime / "rootstock", remember
    remember()
    with contextlib.suppress(Exception):
        stop_workers([], all_workers=True)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(runtime, ignore_errors=True)


@contextlib.contextmanager
def process_group(argv: list[str], **kwargs):
    """Start ``argv`` in its own session; on exit, kill the whole group."""
    proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
