"""atomate2 0.1.5 force-field makers on a Rootstock EMT worker, run by jobflow's
run_locally and compared with in-process ASE EMT on the same structures.

Each job must stop its worker when it ends (atomate2 caches the calculator and never
closes it) unless ``keep_worker=True``; the task document names the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.filters import FrechetCellFilter
from ase.optimize import FIRE
from jobflow import JobStore, run_locally
from maggma.stores import MemoryStore
from pymatgen.io.ase import AseAtomsAdaptor

import rootstock
from rootstock.integrations.atomate2 import (
    RootstockMDMaker,
    RootstockRelaxMaker,
    RootstockStaticMaker,
)
from rootstock.runtime import RootstockCalculator
from tests.integration.killing import is_running

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "integrations.md"
EXAMPLE = re.compile(r"<!-- example: atomate2 -->\s*```python\n(.*?)```\s*<!-- /example -->", re.S)

CLOSE = {"rtol": 0, "atol": 1e-10}


def rattled_cu(seed: int = 0):
    """8 Cu atoms (cubic fcc, 2x1x1), rattled, slightly compressed."""
    atoms = bulk("Cu", "fcc", a=3.55, cubic=True).repeat((2, 1, 1))
    atoms.rattle(stdev=0.05, seed=seed)
    return atoms


def run(job):
    """Run one job with a memory store in the current directory; return its output."""
    store = JobStore(MemoryStore(), additional_stores={"data": MemoryStore()})
    responses = run_locally(job, store=store, create_folders=False, ensure_success=True, log=False)
    return responses[job.uuid][1].output


def worker_children() -> set[int]:
    """Process ids of this process's live descendants (the workers it started)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if is_running(p.pid)}


@pytest.fixture(autouse=True)
def in_tmp_cwd(tmp_path: Path, monkeypatch):
    """Jobs write nothing, but run in a private directory in case they do."""
    monkeypatch.chdir(tmp_path)


@pytest.mark.timeout(300)
def test_static_matches_emt_and_stops_worker(fake_built_root: Path):
    atoms = rattled_cu()
    before = worker_children()
    maker = RootstockStaticMaker(checkpoint="emt", root=str(fake_built_root))
    doc = run(maker.make(AseAtomsAdaptor.get_structure(atoms)))

    ref = atoms.copy()
    ref.calc = EMT()
    assert doc.forcefield_name == "rootstock:emt"
    assert doc.forcefield_version == rootstock.__version__
    np.testing.assert_allclose(doc.output.energy, ref.get_potential_energy(), **CLOSE)
    np.testing.assert_allclose(np.array(doc.output.forces), ref.get_forces(), **CLOSE)
    # atomate2 stores stress in kbar, sign and unit converted from ASE's eV/A^3.
    assert doc.output.stress is not None
    assert maker._calculator is None
    assert worker_children() == before


@pytest.mark.timeout(300)
def test_static_document_carries_the_provenance_through_the_store(fake_built_root: Path):
    """The calculator's provenance, read back from the stored (serialised) document."""
    maker = RootstockStaticMaker(checkpoint="emt", root=str(fake_built_root))
    job = maker.make(AseAtomsAdaptor.get_structure(rattled_cu(seed=5)))
    store = JobStore(MemoryStore(), additional_stores={"data": MemoryStore()})
    run_locally(job, store=store, create_folders=False, ensure_success=True, log=False)
    stored = store.query_one({"uuid": job.uuid}, load=True)["output"]
    provenance = stored["entry"]["parameters"]["provenance"]
    built = json.loads((fake_built_root / "envs" / "emt" / "rootstock-env.json").read_text())
    assert (provenance["checkpoint"], provenance["env"]) == ("emt", "emt")
    assert provenance["build_id"] == built["build_id"]
    assert provenance["rootstock_version"] == rootstock.__version__
    assert provenance["device"] == "cpu"  # the worker ran before the document was made
    expected = RootstockCalculator("emt", root=fake_built_root, device="cpu").provenance
    assert provenance == {**expected, "device": "cpu"}


@pytest.mark.timeout(300)
def test_relax_matches_ase_fire_with_emt(fake_built_root: Path):
    atoms = rattled_cu(seed=1)
    fmax, steps = 0.01, 300
    maker = RootstockRelaxMaker(
        checkpoint="emt",
        root=str(fake_built_root),
        relax_cell=True,
        steps=steps,
        relax_kwargs={"fmax": fmax},
    )
    before = worker_children()
    doc = run(maker.make(AseAtomsAdaptor.get_structure(atoms)))
    assert worker_children() == before

    # atomate2's AseRelaxer: FIRE on a FrechetCellFilter when relax_cell is set.
    ref = atoms.copy()
    ref.calc = EMT()
    FIRE(FrechetCellFilter(ref), logfile=None).run(fmax=fmax, steps=steps)

    final = AseAtomsAdaptor.get_atoms(doc.output.structure)
    assert doc.forcefield_name == "rootstock:emt"
    np.testing.assert_allclose(final.cell.array, ref.cell.array, rtol=0, atol=1e-6)
    np.testing.assert_allclose(final.positions, ref.positions, rtol=0, atol=1e-6)
    np.testing.assert_allclose(doc.output.energy, ref.get_potential_energy(), rtol=0, atol=1e-8)


@pytest.mark.timeout(300)
def test_md_frames_match_emt(fake_built_root: Path):
    atoms = rattled_cu(seed=2)
    n_steps, seed = 10, 7
    maker = RootstockMDMaker(
        checkpoint="emt",
        root=str(fake_built_root),
        ensemble="nve",
        n_steps=n_steps,
        time_step=1.0,
        temperature=300.0,
        mb_velocity_seed=seed,
        zero_linear_momentum=False,
        zero_angular_momentum=False,
        ionic_step_data=("structure", "energy", "forces"),
    )
    before = worker_children()
    doc = run(maker.make(AseAtomsAdaptor.get_structure(atoms)))
    assert worker_children() == before
    assert doc.forcefield_name == "rootstock:emt"
    # The MD document carries the provenance where the static one does.
    assert doc.entry.parameters["provenance"]["checkpoint"] == "emt"
    assert doc.entry.parameters["provenance"]["device"] == "cpu"

    steps = doc.output.ionic_steps
    assert len(steps) == n_steps + 1
    ref = atoms.copy()
    ref.calc = EMT()
    np.testing.assert_allclose(steps[0].energy, ref.get_potential_energy(), rtol=0, atol=1e-8)
    # Every stored frame, re-evaluated with in-process EMT, gives the stored results.
    for step in steps:
        frame = AseAtomsAdaptor.get_atoms(step.structure)
        frame.calc = EMT()
        np.testing.assert_allclose(step.energy, frame.get_potential_energy(), rtol=0, atol=1e-8)
        np.testing.assert_allclose(np.array(step.forces), frame.get_forces(), rtol=0, atol=1e-8)
    moved = AseAtomsAdaptor.get_atoms(steps[-1].structure).positions - atoms.positions
    assert np.abs(moved).max() > 1e-4


@pytest.mark.timeout(300)
def test_keep_worker_leaves_the_jobs_worker_running(fake_built_root: Path):
    structure = AseAtomsAdaptor.get_structure(rattled_cu(seed=3))
    maker = RootstockStaticMaker(checkpoint="emt", root=str(fake_built_root), keep_worker=True)
    job = maker.make(structure)
    run(job)
    # jobflow deep-copies the maker into the job: the job's copy holds the worker.
    calc = job.function.__self__._calculator
    pid = calc.worker_pid
    assert pid is not None and is_running(pid)
    calc.close()
    with contextlib.suppress(psutil.NoSuchProcess):  # already gone and reaped
        psutil.Process(pid).wait(timeout=30)
    assert not is_running(pid)


@pytest.mark.timeout(300)
def test_second_checkpoint_is_named_in_document(fake_built_root: Path):
    structure = AseAtomsAdaptor.get_structure(rattled_cu(seed=4))
    doc = run(
        RootstockStaticMaker(checkpoint="emt-offset-0", root=str(fake_built_root)).make(structure)
    )
    ref = AseAtomsAdaptor.get_atoms(structure)
    ref.calc = EMT()
    assert doc.forcefield_name == "rootstock:emt-offset-0"
    np.testing.assert_allclose(doc.output.energy, ref.get_potential_energy(), **CLOSE)


def test_maker_round_trips_through_json():
    maker = RootstockRelaxMaker(checkpoint="emt", root="/some/root", device="cpu", keep_worker=True)
    again = RootstockRelaxMaker.from_dict(maker.as_dict())
    assert (again.checkpoint, again.root, again.keep_worker) == ("emt", "/some/root", True)
    assert again.ase_calculator_name == "rootstock:emt"


@pytest.mark.timeout(120)
def test_import_without_atomate2_names_the_extra():
    code = (
        "import sys; sys.modules['atomate2'] = None\n"
        "from rootstock.errors import MissingExtra\n"
        "try:\n"
        "    import rootstock.integrations.atomate2\n"
        "except MissingExtra as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True
    ).stdout
    assert "pip install 'rootstock[atomate2]'" in out


def doc_example() -> str:
    """The atomate2 example of docs/integrations.md."""
    match = EXAMPLE.search(DOCS.read_text())
    assert match is not None, f"no '<!-- example: atomate2 -->' python block in {DOCS}"
    return match.group(1)


@pytest.mark.timeout(300)
def test_docs_example_runs(fake_built_root: Path, capsys):
    before = worker_children()
    namespace = {"root": str(fake_built_root)}
    exec(compile(doc_example(), "docs/integrations.md:atomate2", "exec"), namespace)
    assert "rootstock:emt" in capsys.readouterr().out
    assert worker_children() == before
