"""A worker vendored by the previous release still serves today's client.

Every env holds the rootstock it was built with, so the client talks to workers older
than itself (docs/protocol.md, "What may change in wire/"). The env here is a private
copy of the built EMT env whose site-packages holds the rootstock of a wheel in
tests/fixtures/wire/ instead of today's: one test per wheel there (now commit 15e6cef's,
from before the contract moved into ``rootstock/wire/``; the README there says how it
was built). Today's RootstockCalculator then drives it through every frame it sends:
INIT (twice, and with extras), POSDATA, GETFORCE, BATCH, an ERROR reply, a
per-structure error in BATCHREADY, and EXIT.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator
from rootstock.errors import WorkerError

pytestmark = pytest.mark.timeout(600)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wire"
OLD_WHEELS = sorted(FIXTURES.glob("rootstock-*-py3-none-any.whl"))

CLOSE = {"rtol": 1e-12, "atol": 1e-12}


def cu(repeat=(2, 1, 1), seed=0) -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * repeat
    atoms.rattle(0.05, seed=seed)
    return atoms


def alloy() -> Atoms:
    atoms = cu((1, 1, 2), seed=1)
    atoms.numbers[::3] = 47
    atoms.info["charge"] = 1
    return atoms


def uranium() -> Atoms:
    atoms = cu(seed=3)
    atoms.numbers[0] = 92  # EMT has no parameters for U: the model raises
    return atoms


def emt_results(atoms: Atoms) -> dict[str, np.ndarray | float]:
    reference = atoms.copy()
    reference.calc = EMT()
    return {
        "energy": reference.get_potential_energy(),
        "forces": reference.get_forces(),
        "stress": reference.get_stress(),
    }


def single_call_results(atoms: Atoms) -> dict[str, np.ndarray | float]:
    """Energy, forces and stress from the calculator ``atoms`` carries."""
    return {
        "energy": atoms.get_potential_energy(),
        "forces": atoms.get_forces(),
        "stress": atoms.get_stress(),
    }


def assert_results(got: dict, atoms: Atoms) -> None:
    for name, expected in emt_results(atoms).items():
        np.testing.assert_allclose(got[name], expected, **CLOSE, err_msg=name)


def site_packages(root: Path) -> Path:
    env = (root / "envs" / "emt").resolve()
    (site,) = env.glob("lib/python*/site-packages")
    return site


@pytest.fixture
def old_root(own_root: Path, old_wheel: Path) -> Path:
    """A private root whose EMT env holds the rootstock of ``old_wheel``."""
    site = site_packages(own_root)
    # Removed, never written through: uv hard-links files from its cache.
    shutil.rmtree(site / "rootstock")
    for dist_info in site.glob("rootstock-*.dist-info"):
        shutil.rmtree(dist_info)
    with zipfile.ZipFile(old_wheel) as wheel:
        wheel.extractall(site)
    return own_root


def test_the_fixture_wheel_is_there():
    # Without it the test below would silently test nothing.
    assert OLD_WHEELS


@pytest.mark.usefixtures("runtime_isolation")
@pytest.mark.parametrize("old_wheel", OLD_WHEELS, ids=lambda wheel: wheel.name.split("-")[1])
def test_a_worker_from_the_previous_releases_wheel_serves_todays_client(
    old_root: Path, old_wheel: Path
):
    site = site_packages(old_root)
    # The old layout: the contract was runtime/protocol.py, and there was no wire/.
    old_framing = site / "rootstock" / "runtime" / "protocol.py"
    assert old_framing.is_file()
    assert not (site / "rootstock" / "wire").exists()
    assert not list(site.glob("rootstock/**/*.pyc"))

    with RootstockCalculator(root=old_root, checkpoint="emt", device="cpu", shared=False) as calc:
        # Single calls: INIT + POSDATA + GETFORCE, then POSDATA alone for moved atoms.
        atoms = cu()
        atoms.calc = calc
        assert_results(single_call_results(atoms), atoms)
        pid = calc.worker_pid
        # Kept to read the exit status once the calculator has closed.
        process = calc._session.process if calc._session is not None else None
        atoms.positions[0] += 0.03
        assert atoms.get_potential_energy() == pytest.approx(
            emt_results(atoms)["energy"], rel=1e-12
        )
        # A new system (species, info): a new INIT; then one asking for an extra.
        other = alloy()
        other.calc = calc
        assert_results(single_call_results(other), other)
        reference = other.copy()
        reference.calc = EMT()
        np.testing.assert_allclose(
            other.get_potential_energies(), reference.get_potential_energies(), **CLOSE
        )

        # BATCH / BATCHREADY, mixed systems in one chunk.
        images = [cu(seed=4), alloy(), cu((1, 1, 1), seed=5)]
        for result, image in zip(calc.calculate_batch(images), images, strict=True):
            assert_results(result, image)

        # ERROR: the model raised in the calculation; the worker stays up.
        bad = uranium()
        bad.calc = calc
        with pytest.raises(WorkerError, match="No EMT-potential for U") as caught:
            bad.get_potential_energy()
        assert "NotImplementedError" in caught.value.remote_traceback
        # A failing structure in a batch fails alone (BATCHREADY's error entry).
        out = calc.calculate_batch([cu(seed=6), uranium()], errors="return")
        assert isinstance(out[1], WorkerError)
        assert "No EMT-potential for U" in str(out[1])
        assert isinstance(out[0], dict)
        assert_results(out[0], cu(seed=6))
        # And the single-call system is re-sent after the error.
        assert atoms.get_potential_energy() == pytest.approx(
            emt_results(atoms)["energy"], rel=1e-12
        )
        assert calc.worker_pid == pid

    # A clean close: EXIT, and the worker exits with status 0.
    assert process is not None
    assert process.returncode == 0

    # The worker really ran the old code: importing the old framing module from the
    # replaced site-packages left its bytecode there (nothing else imports it).
    assert list((old_framing.parent / "__pycache__").glob("protocol.*.pyc"))
    probe = subprocess.run(
        [
            str((old_root / "envs" / "emt").resolve() / "bin" / "python"),
            "-I",
            "-c",
            "import importlib.metadata as m, importlib.util as u, json, rootstock; "
            "print(json.dumps([rootstock.__file__, m.version('rootstock'), "
            "u.find_spec('rootstock.wire') is None]))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    module_file, version, no_wire = json.loads(probe.stdout)
    assert Path(module_file).is_relative_to(site)
    assert version == old_wheel.name.split("-")[1]
    assert no_wire
