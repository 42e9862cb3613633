"""quacc's MLIP recipes drive a Rootstock EMT worker; results match in-process EMT.

quacc (plain, 1.8.x) builds ``RootstockCalculator(**kwargs)`` itself and caches it;
each test clears that cache and checks that no worker outlives it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.build import add_adsorbate, bulk, fcc100
from ase.calculators.emt import EMT
from ase.constraints import FixAtoms
from ase.filters import FrechetCellFilter
from ase.mep import NEB
from ase.optimize import BFGS, FIRE
from quacc import change_settings
from quacc.recipes.mlip._base import pick_calculator
from quacc.recipes.mlip.core import relax_job, static_job
from quacc.recipes.mlip.md import md_job
from quacc.runners.ase import Runner
from quacc.schemas.ase import Summarize

import rootstock
from rootstock.runtime import RootstockCalculator
from tests.integration.killing import is_running
from tests.integration.quacc_cache import emptied_quacc_cache

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(600)]

DOCS = Path(__file__).parents[2] / "docs" / "integrations.md"
EXAMPLE = re.compile(r"<!-- example: quacc -->\s*```python\n(.*?)```\s*<!-- /example -->", re.S)


@pytest.fixture
def quacc_env(tmp_path: Path, fake_built_root: Path) -> Iterator[dict]:
    """quacc's dirs under tmp_path, a clean cache, and no worker left afterwards."""
    results = tmp_path / "results"
    results.mkdir()
    changes = {"RESULTS_DIR": results, "SCRATCH_DIR": tmp_path / "scratch"}
    with emptied_quacc_cache(), change_settings(changes):
        yield {"checkpoint": "emt", "root": str(fake_built_root), "device": "cpu"}


def _emt_static(atoms: Atoms) -> tuple[float, np.ndarray]:
    atoms = atoms.copy()
    atoms.calc = EMT()
    return atoms.get_potential_energy(), atoms.get_forces()


def _rattled_cu() -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True) * (2, 2, 2)  # 32 atoms
    atoms.rattle(0.05, seed=3)
    return atoms


@pytest.mark.timeout(600)  # may wait for the session's env builds
def test_static_job_matches_emt(quacc_env: dict, fake_built_root: Path) -> None:
    atoms = _rattled_cu()
    doc = static_job(atoms, "rootstock", **quacc_env)
    energy, forces = _emt_static(atoms)
    assert abs(doc["results"]["energy"] - energy) < 1e-9
    np.testing.assert_allclose(doc["results"]["forces"], forces, atol=1e-9)
    assert doc["parameters"]["version"] == rootstock.__version__
    # The provenance rides in the calculator's parameters, which quacc's summary keeps.
    provenance = doc["parameters"]["provenance"]
    built = json.loads((fake_built_root / "envs" / "emt" / "rootstock-env.json").read_text())
    assert (provenance["checkpoint"], provenance["build_id"]) == ("emt", built["build_id"])
    assert (provenance["device"], provenance["rootstock_version"]) == (
        "cpu",
        rootstock.__version__,
    )
    expected = RootstockCalculator("emt", root=fake_built_root, device="cpu").provenance
    # quacc's summary drops None values (here the cluster and torch's version).
    assert provenance == {
        **{k: v for k, v in expected.items() if v is not None},
        "packages": {k: v for k, v in expected["packages"].items() if v is not None},
        "device": "cpu",
    }
    # quacc's cache: a second job reuses the same calculator, hence the same worker
    first = pick_calculator("rootstock", **quacc_env)
    static_job(atoms, "rootstock", **quacc_env)
    assert pick_calculator("rootstock", **quacc_env) is first
    assert first.worker_pid is not None and is_running(first.worker_pid)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("relax_cell", [False, True])
def test_relax_job_matches_emt(quacc_env: dict, relax_cell: bool) -> None:
    atoms = _rattled_cu()
    doc = relax_job(
        atoms, "rootstock", relax_cell=relax_cell, opt_params={"fmax": 0.01}, **quacc_env
    )
    reference = atoms.copy()
    reference.calc = EMT()
    target = FrechetCellFilter(reference) if relax_cell else reference
    BFGS(target, logfile=None).run(fmax=0.01, steps=1000)
    relaxed = doc["atoms"]
    assert abs(doc["results"]["energy"] - reference.get_potential_energy()) < 1e-6
    np.testing.assert_allclose(relaxed.positions, reference.positions, atol=1e-4)
    np.testing.assert_allclose(relaxed.cell[:], reference.cell[:], atol=1e-4)
    assert np.abs(doc["results"]["forces"]).max() < 0.01
    if relax_cell:
        assert abs(relaxed.cell[0, 0] - 2 * 3.59) < 0.02  # EMT Cu, a ≈ 3.59 Å
    else:
        np.testing.assert_array_equal(relaxed.cell[:], atoms.cell[:])


@pytest.mark.timeout(180)
def test_md_job_frames_match_emt(quacc_env: dict) -> None:
    atoms = _rattled_cu()
    doc = md_job(atoms, "rootstock", steps=20, **quacc_env)
    frames, results = doc["trajectory"], doc["trajectory_results"]
    assert len(frames) == 21 and len(results) == 21
    worst_e = worst_f = 0.0
    for frame, result in zip(frames, results, strict=True):
        energy, forces = _emt_static(frame)
        worst_e = max(worst_e, abs(result["energy"] - energy))
        worst_f = max(worst_f, float(np.abs(result["forces"] - forces).max()))
    assert worst_e < 1e-9 and worst_f < 1e-9
    # the trajectory moved: the frames are not 21 copies of one structure
    assert np.abs(frames[-1].positions - frames[0].positions).max() > 1e-3


def _neb_images() -> list[Atoms]:
    """Au hopping between hollow sites on a 2x2x3 Al(100) slab (13 atoms), 5 images."""
    initial = fcc100("Al", size=(2, 2, 3))
    add_adsorbate(initial, "Au", 1.7, "hollow")
    initial.center(axis=2, vacuum=4.0)
    initial.set_constraint(FixAtoms(mask=[a.tag > 1 for a in initial]))
    final = initial.copy()
    final.positions[-1, 0] += initial.cell[0, 0] / 2
    for end in (initial, final):
        end.calc = EMT()
        BFGS(end, logfile=None).run(fmax=0.01)
    images = [initial] + [initial.copy() for _ in range(3)] + [final]
    NEB(images, method="improvedtangent").interpolate()
    for image in images:
        image.calc = None
    return images


@pytest.mark.timeout(300)
def test_neb_runner_deep_copies_and_matches_ase(quacc_env: dict) -> None:
    images = _neb_images()
    calc = pick_calculator("rootstock", **quacc_env)
    runner = Runner(images, calc)
    copies = [image.calc for image in runner.atoms]
    assert len({id(c) for c in copies}) == 5 and calc not in copies
    dyn = runner.run_neb(
        fmax=0.05, max_steps=300, optimizer=FIRE, neb_kwargs={"method": "improvedtangent"}
    )
    summary = Summarize().neb(dyn, len(images))
    # every image ran on the one shared worker, not one worker each
    pids = {c.worker_pid for c in copies[1:-1]}
    assert len(pids) == 1 and None not in pids

    reference = [image.copy() for image in images]
    for image in reference:
        image.calc = EMT()
    FIRE(NEB(reference, method="improvedtangent"), logfile=None).run(fmax=0.05, steps=300)

    final = summary["trajectory"][-len(images) :]
    worst_pos = max(
        float(np.abs(a.positions - b.positions).max())
        for a, b in zip(final, reference, strict=True)
    )
    assert worst_pos < 1e-6
    for frame, result in zip(final[1:-1], summary["trajectory_results"][-4:-1], strict=True):
        assert abs(result["energy"] - _emt_static(frame)[0]) < 1e-9
    barrier = max(r.get_potential_energy() for r in reference) - reference[0].get_potential_energy()
    assert 0.1 < barrier < 1.0


def _example_source() -> str:
    match = EXAMPLE.search(DOCS.read_text())
    assert match is not None, f"no <!-- example: quacc --> block in {DOCS}"
    return match.group(1)


@pytest.mark.timeout(300)
def test_docs_example_runs(quacc_env: dict, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_example_source(), "docs/integrations.md", "exec"), {"root": quacc_env["root"]})
    lines = capsys.readouterr().out.split("\n")
    energy, version = lines[0].split()
    assert abs(float(energy) - _emt_static(bulk("Cu", "fcc", a=3.7, cubic=True))[0]) < 1e-9
    assert version == rootstock.__version__
    assert abs(float(lines[1]) - 3.59) < 0.01
    assert lines[2] == "21"


@pytest.mark.timeout(60)
def test_import_without_quacc_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['quacc'] = None\n"
        "from rootstock.errors import MissingExtra\n"
        "try:\n    import rootstock.integrations.quacc\n"
        "except MissingExtra as e:\n    print(e.hint)\nelse:\n    print('imported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert "pip install 'rootstock[quacc]'" in out.stdout
