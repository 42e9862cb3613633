"""Real uv builds of an env whose ``[tool.uv]`` routes a package to an explicit index.

The package ``rootstock-probe-pkg`` exists only in a local flat index that the env
file declares ``explicit`` and routes to through ``[tool.uv.sources]``, so a build
that loses the routing between locking and installing looks it up on PyPI and
fails. Everything else comes from PyPI through the shared uv cache.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from rootstock.errors import BuildError
from rootstock.install import build
from rootstock.install.build import BuildOptions, build_env
from rootstock.install.envfile import read_env_file
from rootstock.install.interpreters import probe_interpreter
from rootstock.install.machine import resolve_layout
from tests.conftest import run_rootstock

pytestmark = pytest.mark.timeout(900)

PROBE = "rootstock-probe-pkg"
PROBE_VERSION = "1.0"

ROUTED_ENV = textwrap.dedent('''\
    """An EMT env whose probe package comes only from an explicit local index."""

    # /// script
    # requires-python = ">=3.11"
    # dependencies = ["ase>=3.23", "numpy", "{probe}"]
    #
    # [tool.uv.sources]
    # {probe} = {{ index = "probe" }}
    #
    # [[tool.uv.index]]
    # name = "probe"
    # url = "{index}"
    # format = "flat"
    # explicit = true
    # ///

    CHECKPOINTS = {{"{name}-1": "{name}-1"}}


    def setup(checkpoint, device="cuda", **kw):
        from ase.calculators.emt import EMT

        return EMT()
    ''')

IMPORT_PROBE = "import rootstock_probe_pkg as p; print(p.VERSION)"


def write_pure_wheel(directory: Path, project: str, version: str) -> Path:
    """A minimal pure-Python wheel of ``project`` whose module knows its version."""
    module = project.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f'VERSION = "{version}"\n',
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: rootstock-tests\n"
            "Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        encoded = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{name},sha256={encoded},{len(text.encode())}")
    record.append(f"{dist_info}/RECORD,,")
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return wheel


@pytest.fixture
def probe_index(tmp_path: Path) -> Path:
    """A flat index (a directory of wheels) holding the only copy of the probe package."""
    index = tmp_path / "probe-index"
    write_pure_wheel(index, PROBE, PROBE_VERSION)
    return index


def routed_env(directory: Path, name: str, index: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(ROUTED_ENV.format(probe=PROBE, index=index, name=name))
    return path


def probe_version(python: Path) -> str:
    return subprocess.run(
        [str(python), "-I", "-c", IMPORT_PROBE],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()


def test_locked_build_installs_from_the_explicit_index(
    scratch_root: Path, tmp_path: Path, probe_index: Path
):
    env_file = routed_env(tmp_path / "src", "routed", probe_index)
    # A constraint set the way the tests pin torch: the lock takes it in, and the
    # install from the lock must not trip over it.
    constraint = tmp_path / "probe-constraint.txt"
    constraint.write_text(f"{PROBE}=={PROBE_VERSION}\n")
    run_rootstock("install", env_file, "--root", scratch_root, env={"UV_CONSTRAINT": constraint})

    env_dir = scratch_root / "envs" / "routed"
    assert probe_version(env_dir / "bin" / "python") == PROBE_VERSION
    lock = (scratch_root / "environments" / "routed.py.lock").read_text()
    assert (env_dir / "env_source.py.lock").read_text() == lock
    assert f'source = {{ registry = "{probe_index}" }}' in lock

    # A rebuild from the recorded lock keeps the routing too.
    run_rootstock("install", "routed", "--force", "--root", scratch_root)
    assert probe_version(env_dir / "bin" / "python") == PROBE_VERSION


def test_unlocked_build_installs_from_the_explicit_index(
    scratch_root: Path, tmp_path: Path, probe_index: Path, monkeypatch
):
    """When locking fails, the fallback install still honours the env's sources."""
    real_run_uv = build.run_uv

    def lock_fails(layout, args, **kwargs):
        if args[0] == "lock":
            raise BuildError("uv failed while locking (simulated)")
        return real_run_uv(layout, args, **kwargs)

    monkeypatch.setattr(build, "run_uv", lock_fails)
    env = read_env_file(routed_env(tmp_path / "src", "unlocked", probe_index))
    base_python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}"
    interpreter = probe_interpreter(base_python, "explicit")
    assert interpreter is not None, base_python

    result = build_env(
        resolve_layout(scratch_root), env, interpreter, BuildOptions(), None, lambda _: None
    )
    try:
        assert result.lock_text is None and result.metadata["locked"] is False
        assert any("could not be locked" in w for w in result.warnings), result.warnings
        assert probe_version(result.staging / "bin" / "python") == PROBE_VERSION
    finally:
        shutil.rmtree(result.staging, ignore_errors=True)
