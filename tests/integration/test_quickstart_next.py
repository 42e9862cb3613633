"""The quickstart's "what next" block works when pasted into a new shell (issue 31).

``scripts/dev/quickstart-next`` prints the block; here it is printed for a demo-like
root (a private copy of the run's EMT root, with its own config.toml) and a dashboard
database, and its lines run in a bash that starts without rootstock's variables or
venv on PATH, as a new terminal would:

* the set-up lines (``cd``, ``source .venv/bin/activate``, the exports), ``rootstock
  status`` and the Python snippet, verbatim: the energy it prints is EMT's;
* the dashboard line, verbatim: the dashboard answers on the printed port, then its
  process group is killed;
* the CHGNet lines, cheaply (building CHGNet takes minutes and 1.5 GB):
  ``install ... --dry-run`` plans the env and names ``chgnet-0.3.0``, and ``add``
  parses the printed options (``--help`` after them).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from tests.conftest import REPO, run_rootstock
from tests.integration.conftest import process_group

pytestmark = pytest.mark.timeout(300)

SCRIPT = REPO / "scripts" / "dev" / "quickstart-next"


@pytest.fixture
def demo(emt_root: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A demo-like root (a copy of ``emt_root``: envs hard-linked) and a dashboard dir."""
    root = tmp_path / "demo root"  # a space: the printed lines must quote paths
    shutil.copytree(
        emt_root,
        root,
        symlinks=True,
        ignore=lambda directory, _names: ["envs"] if Path(directory) == emt_root else [],
    )
    subprocess.run(["cp", "-al", str(emt_root / "envs"), str(root / "envs")], check=True)
    config = {"ROOTSTOCK_CONFIG": str(root / "config.toml")}
    run_rootstock("init", "--root", root, "--cluster", "testbox", "--yes", "--force", env=config)
    dash = tmp_path / "demo-dashboard"
    dash.mkdir()
    run_rootstock("dashboard", "add-cluster", "testbox", "--db", dash / "dashboard.sqlite3")
    return root, dash


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def new_shell_env() -> dict[str, str]:
    """This process's environment as a new terminal has it: no rootstock variables, no
    venv on PATH (the run's temp dir and caches stay, so nothing leaks out of the run)."""
    venv_bin = str(REPO / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOTSTOCK_")}
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    env["ROOTSTOCK_TEST_RUN_DIR"] = os.environ["ROOTSTOCK_TEST_RUN_DIR"]
    return env


def bash(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env=new_shell_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_what_next_runs_as_printed(demo: tuple[Path, Path], tmp_path: Path):
    root, dash = demo
    port = free_port()
    printed = subprocess.run(
        [SCRIPT, root, dash, f"http://127.0.0.1:{port}/"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    lines = printed.split("\n")

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    setup = "\n".join(lines[first("cd ") : first("export ROOTSTOCK_CONFIG=") + 1])
    quoted_root = str(root).replace(" ", "\\ ")
    assert f"export ROOTSTOCK_ROOT={quoted_root}\n" in setup
    # The set-up, status and the snippet, verbatim: everything up to the snippet's end.
    through_snippet = "\n".join(lines[first("cd ") : first("PY") + 1])
    assert "python - <<'PY'" in through_snippet
    ran = bash(through_snippet)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "emt" in ran.stdout  # rootstock status found the demo root
    energy = float(re.search(r"^E = (\S+) eV$", ran.stdout, re.M).group(1))
    reference = bulk("Cu", "fcc", a=3.6)
    reference.calc = EMT()
    assert energy == pytest.approx(reference.get_potential_energy(), abs=1e-6)

    # The CHGNet lines: the install plans (dry run), add takes the printed options.
    install, add = lines[first("rootstock install ")], lines[first("rootstock add ")]
    assert (install, add) == (
        "rootstock install environments/chgnet.py",
        "rootstock add chgnet-0.3.0 --device cpu",
    )
    planned = bash(f"{setup}\n{install} --dry-run")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "chgnet-0.3.0" in planned.stdout, planned.stdout
    parsed = bash(f"{setup}\n{add} --help")
    assert parsed.returncode == 0, parsed.stdout + parsed.stderr

    # The dashboard, served again by the printed command on the printed port.
    serve = lines[first("rootstock dashboard serve ")]
    assert f"--port {port}" in serve and f"http://127.0.0.1:{port}/" in printed
    log = (tmp_path / "serve.log").open("w")
    with process_group(
        ["bash", "-c", f"{setup}\nexec {serve}"],
        env=new_shell_env(),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    ) as proc:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                    assert page.status == 200
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.2)
    log.close()
