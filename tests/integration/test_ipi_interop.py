"""``rootstock serve`` driven by standard i-PI servers: ASE's SocketIOCalculator and i-PI."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.socketio import SocketIOCalculator
from ase.io import read, write
from ase.optimize import BFGS

from .conftest import process_group

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(240)]

ROOTSTOCK = [sys.executable, "-m", "rootstock.cli.main"]


def serve_argv(root: Path, socket_path: str, structure: Path, *extra: str) -> list[str]:
    return [
        *ROOTSTOCK,
        "serve",
        "emt",
        "--socket",
        socket_path,
        "--structure",
        str(structure),
        "--root",
        str(root),
        "--device",
        "cpu",
        "--connect-timeout",
        "60",
        *extra,
    ]


def start_structure(tmp_path: Path):
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 2, 2)
    atoms.rattle(0.08, seed=11)
    path = tmp_path / "start.xyz"
    write(path, atoms, format="extxyz")
    return read(path), path


def bfgs_energies(atoms, calc, steps: int) -> list[float]:
    atoms.calc = calc
    energies: list[float] = []
    opt = BFGS(atoms, logfile=None)
    opt.attach(lambda: energies.append(atoms.get_potential_energy()))
    opt.run(fmax=1e-6, steps=steps)
    return energies


def test_ase_socketio_drives_rootstock_serve_for_20_bfgs_steps(fake_built_root, tmp_path):
    atoms, structure = start_structure(tmp_path)
    expected = bfgs_energies(atoms.copy(), EMT(), steps=20)
    # ASE binds /tmp/ipi_<name> itself; a unique name keeps parallel runs apart.
    name = f"rootstock-test-{uuid.uuid4().hex[:12]}"
    log = tmp_path / "serve.log"
    with (
        SocketIOCalculator(unixsocket=name, timeout=120) as calc,
        open(log, "wb") as out,
        process_group(
            serve_argv(fake_built_root, f"/tmp/ipi_{name}", structure),
            stdout=out,
            stderr=subprocess.STDOUT,
        ) as serve,
    ):
        got = bfgs_energies(atoms, calc, steps=20)
        calc.close()  # the server hangs up; the worker sees EOF and serve exits 0
        assert serve.wait(timeout=60) == 0, log.read_text()
    assert len(got) == len(expected) == 21
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-8)


def test_serve_retries_until_the_server_is_up(fake_built_root, tmp_path):
    atoms, structure = start_structure(tmp_path)
    name = f"rootstock-test-{uuid.uuid4().hex[:12]}"
    log = tmp_path / "serve.log"
    with (
        open(log, "wb") as out,
        process_group(
            serve_argv(fake_built_root, f"/tmp/ipi_{name}", structure),
            stdout=out,
            stderr=subprocess.STDOUT,
        ) as serve,
    ):
        # Bind only once the worker is up and retrying.
        deadline = time.monotonic() + 120
        while "waiting for a server" not in log.read_text():
            assert serve.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(0.3)
        with SocketIOCalculator(unixsocket=name, timeout=120) as calc:
            atoms.calc = calc
            ref = atoms.copy()
            ref.calc = EMT()
            assert atoms.get_potential_energy() == pytest.approx(
                ref.get_potential_energy(), abs=1e-10
            )
        assert serve.wait(timeout=60) == 0, log.read_text()


def test_serve_without_a_structure_refuses_before_starting_a_worker(fake_built_root):
    # A standard server sends no species: refused at once (exit 2), not at the first
    # POSDATA with the server left waiting for a client that is gone.
    name = f"rootstock-test-{uuid.uuid4().hex[:12]}"
    argv = [
        *ROOTSTOCK,
        "serve",
        "emt",
        "--socket",
        f"/tmp/ipi_{name}",
        "--root",
        str(fake_built_root),
        "--device",
        "cpu",
    ]
    with process_group(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as serve:
        _, err = serve.communicate(timeout=60)
    assert serve.returncode == 2, err
    assert b"hint: pass --structure FILE" in err
    assert b"waiting for a server" not in err  # no worker was started


IPI_INPUT = """\
<simulation verbosity="low" safe_stride="100">
  <output prefix="md">
    <properties stride="1" filename="out">
      [ step, conserved{{electronvolt}}, temperature{{kelvin}}, potential{{electronvolt}} ]
    </properties>
  </output>
  <total_steps>10</total_steps>
  <prng><seed>31415</seed></prng>
  <ffsocket name="rootstock" mode="unix" pbc="true">
    <address>{address}</address>
    <timeout>60</timeout>
  </ffsocket>
  <system>
    <initialize nbeads="1">
      <file mode="ase">{structure}</file>
      <velocities mode="thermal" units="kelvin">300</velocities>
    </initialize>
    <forces><force forcefield="rootstock"/></forces>
    <motion mode="dynamics">
      <dynamics mode="nve"><timestep units="femtosecond">1.0</timestep></dynamics>
    </motion>
    <ensemble><temperature units="kelvin">300</temperature></ensemble>
  </system>
</simulation>
"""


@pytest.mark.skipif(
    shutil.which("i-pi", path=os.path.dirname(sys.executable)) is None,
    reason="the i-PI package (ipi) is not installed in this venv",
)
def test_ipi_runs_10_md_steps_against_rootstock_serve(fake_built_root, tmp_path):
    atoms, structure = start_structure(tmp_path)
    (tmp_path / "input.xml").write_text(
        IPI_INPUT.format(address="rootstock", structure=structure.name)
    )
    # i-PI's socket goes into a private directory (-S prefix), not /tmp itself.
    sockets = Path(tempfile.mkdtemp(prefix="rootstock-ipi-"))
    ipi = str(Path(sys.executable).parent / "i-pi")
    try:
        with (
            open(tmp_path / "ipi.log", "wb") as ipi_log,
            open(tmp_path / "serve.log", "wb") as serve_log,
            process_group(
                [ipi, "input.xml", "-S", f"{sockets}/ipi_"],
                cwd=tmp_path,
                stdout=ipi_log,
                stderr=subprocess.STDOUT,
            ) as server,
            process_group(
                serve_argv(fake_built_root, f"{sockets}/ipi_rootstock", structure),
                stdout=serve_log,
                stderr=subprocess.STDOUT,
            ) as serve,
        ):
            assert server.wait(timeout=180) == 0, (tmp_path / "ipi.log").read_text()
            assert serve.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    rows = np.loadtxt(tmp_path / "md.out", ndmin=2)
    assert rows[:, 0].tolist() == list(range(11))  # step 0 plus 10 MD steps
    ref = atoms.copy()
    ref.calc = EMT()
    assert rows[0, 3] == pytest.approx(ref.get_potential_energy(), rel=1e-6, abs=1e-6)
    # NVE with forces consistent with the energy: the conserved quantity moves far
    # less than the potential energy does.
    assert np.ptp(rows[:, 1]) < 0.1 * np.ptp(rows[:, 3])


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 1), (signal.SIGINT, 130)])
def test_signals_to_serve_reach_the_worker(fake_built_root, tmp_path, signum, exit_code):
    _, structure = start_structure(tmp_path)
    log = tmp_path / "serve.log"
    nowhere = tmp_path / "no-server-here.sock"
    with (
        open(log, "wb") as out,
        process_group(
            serve_argv(fake_built_root, str(nowhere), structure),
            stdout=out,
            stderr=subprocess.STDOUT,
        ) as serve,
    ):
        deadline = time.monotonic() + 120
        while "waiting for a server" not in log.read_text():
            assert serve.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        (worker,) = children_of(serve.pid)
        serve.send_signal(signum)
        assert serve.wait(timeout=30) == exit_code, log.read_text()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{worker}")
