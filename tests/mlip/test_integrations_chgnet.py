"""Each integration once on a real model: CHGNet through quacc, atomate2, mlipx and LAMMPS.

The EMT suites (tests/integration/test_with_*.py) check the physics of each route in
depth; here each route runs CHGNet 0.3.0 (weights from its wheel) on a small Cu cell,
and must give what a plain :class:`RootstockCalculator` on the same checkpoint gives
for the same positions.

Tolerance: CHGNet runs float32, and both sides run the same worker kind with the same
threads (tests/mlip/conftest.py), so they agree to rounding: energies within 1e-5 eV
per cell, forces within 1e-5 eV/Å (about 10 float32 ulps of the values here); the
LAMMPS energy is summed in another atom order, so it gets 2e-3 eV per 32-atom cell.

Runtime beyond the CHGNet env build (shared through BATCH_TEST_FAMILIES in
tests/conftest.py): each route starts its own CHGNet worker (a model load is ~5 s);
the plain calculator that every test compares with is one worker of the module's own,
started once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk

from rootstock.runtime.calculator import RootstockCalculator
from tests.integration.quacc_cache import emptied_quacc_cache

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(600)]

CHECKPOINT = "chgnet-0.3.0"
ATOL = 1e-5


def rattled_cu(seed: int = 0) -> Atoms:
    """An 8-atom fcc Cu cell (2x2x2 primitive), rattled 0.05 Å."""
    atoms = bulk("Cu", "fcc", a=3.6) * (2, 2, 2)
    atoms.rattle(0.05, seed=seed)
    return atoms


Direct = Callable[[Atoms], tuple[float, np.ndarray]]


@pytest.fixture(scope="module")
def chgnet_env_root(family_env) -> Path:
    """The family root with the CHGNet env (shared by the run: only read here)."""
    return family_env("chgnet")


@pytest.fixture
def chgnet_root(chgnet_env_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The family root with the CHGNet env; each test runs in its own directory."""
    monkeypatch.chdir(tmp_path)
    return chgnet_env_root


@pytest.fixture(scope="module")
def direct(chgnet_env_root: Path) -> Iterator[Direct]:
    """``direct(atoms)``: energy and forces of ``atoms`` from a plain calculator of the
    module's own. ``shared=False``: no route's calculator can land on its worker, so
    every comparison is between two workers, as with a calculator per call; one worker
    serves the whole module instead of a model load per call."""
    with RootstockCalculator(
        CHECKPOINT, root=str(chgnet_env_root), device="cpu", shared=False
    ) as calc:

        def energy_and_forces(atoms: Atoms) -> tuple[float, np.ndarray]:
            atoms = atoms.copy()
            atoms.calc = calc
            return float(atoms.get_potential_energy()), np.array(atoms.get_forces())

        yield energy_and_forces


@pytest.fixture
def quacc_cache() -> Iterator[None]:
    """quacc's calculator cache, emptied around the test; its worker must stop."""
    with emptied_quacc_cache():
        yield


def test_quacc_static_job_on_chgnet(chgnet_root: Path, quacc_cache: None, direct: Direct) -> None:
    from quacc.recipes.mlip.core import static_job

    atoms = rattled_cu(seed=1)
    result = static_job(
        atoms, "rootstock", checkpoint=CHECKPOINT, root=str(chgnet_root), device="cpu"
    )
    energy, forces = direct(atoms)
    assert abs(result["results"]["energy"] - energy) < ATOL
    np.testing.assert_allclose(result["results"]["forces"], forces, rtol=0, atol=ATOL)


def test_atomate2_static_maker_on_chgnet(chgnet_root: Path, direct: Direct) -> None:
    from jobflow import JobStore, run_locally
    from maggma.stores import MemoryStore
    from pymatgen.io.ase import AseAtomsAdaptor

    from rootstock.integrations.atomate2 import RootstockStaticMaker

    atoms = rattled_cu(seed=2)
    job = RootstockStaticMaker(checkpoint=CHECKPOINT, root=str(chgnet_root)).make(
        AseAtomsAdaptor.get_structure(atoms)
    )
    store = JobStore(MemoryStore(), additional_stores={"data": MemoryStore()})
    doc = run_locally(job, store=store, create_folders=False, ensure_success=True)[job.uuid][
        1
    ].output
    energy, forces = direct(atoms)
    assert doc.forcefield_name == f"rootstock:{CHECKPOINT}"
    assert abs(doc.output.energy - energy) < ATOL
    np.testing.assert_allclose(np.array(doc.output.forces), forces, rtol=0, atol=ATOL)


def test_mlipx_structure_optimization_on_chgnet(
    chgnet_root: Path, monkeypatch: pytest.MonkeyPatch, direct: Direct
) -> None:
    import ase.io
    import mlipx
    import zntrack

    from rootstock.integrations.mlipx import rootstock_model

    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["git", "init", "-q"], check=True, timeout=60)
    subprocess.run(["dvc", "init", "-q"], check=True, timeout=120)
    ase.io.write("cu.xyz", rattled_cu(seed=3))
    with zntrack.Project() as project:
        data = mlipx.LoadDataFile(path="cu.xyz")
        relax = mlipx.StructureOptimization(
            data=data.frames, model=rootstock_model(CHECKPOINT, root=str(chgnet_root)),
            fmax=0.05, steps=5,
        )  # fmt: skip
    project.repro()

    frames = relax.frames
    assert len(frames) >= 2  # a real step was taken
    for frame in (frames[0], frames[-1]):
        energy, forces = direct(frame)
        assert abs(frame.get_potential_energy() - energy) < ATOL
        np.testing.assert_allclose(frame.get_forces(), forces, rtol=0, atol=ATOL)
    assert frames[-1].get_potential_energy() < frames[0].get_potential_energy()


def test_lammps_fix_external_on_chgnet(chgnet_root: Path, direct: Direct) -> None:
    from rootstock.integrations.lammps import attach, open_lammps

    lmp = open_lammps()
    try:
        lmp.commands_string(
            "units metal\natom_style atomic\natom_modify map array\nlattice fcc 3.6\n"
            "region box block 0 2 0 2 0 2\ncreate_box 1 box\ncreate_atoms 1 box\n"
            "mass 1 63.546\ndisplace_atoms all random 0.05 0.05 0.05 4928 units box\n"
        )
        with RootstockCalculator(CHECKPOINT, root=str(chgnet_root), device="cpu") as calc:
            fix = attach(lmp, calc, fix_id="ml", elements=["Cu"])
            lmp.command("run 0")
            fix.raise_error()
            pe = float(lmp.get_thermo("pe"))
            n = int(lmp.get_natoms())
            positions = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3), shape=(n * 3,))
            forces = np.ctypeslib.as_array(lmp.gather_atoms("f", 1, 3), shape=(n * 3,))
            assert fix.calls == 1
    finally:
        lmp.close()

    atoms = Atoms(
        f"Cu{n}",
        positions=positions.reshape(-1, 3),
        cell=np.eye(3) * 7.2,
        pbc=True,
    )
    assert n == 32
    energy, want = direct(atoms)
    # LAMMPS sorts its atoms spatially at setup, so the callback sends them in another
    # order and CHGNet sums 32 float32 site energies differently: measured 7.3e-4 eV
    # (5e-6 relative), so the bound is 2e-3 eV per cell. Forces are per atom: 1e-5.
    assert abs(pe - energy) < 2e-3
    np.testing.assert_allclose(forces.reshape(-1, 3), want, rtol=0, atol=ATOL)
