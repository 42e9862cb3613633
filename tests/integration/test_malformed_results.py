"""Malformed model results fail at once, with a message, through a real worker.

The ``malformed-results`` test env is EMT that breaks the property named in
``atoms.info["malformed"]`` (or in its setup kwargs); see tests/envs/malformed_results.py.
Before the worker checked its model's results, forces of shape (n, 4) came back
as silently wrong numbers and put the stream out of step, and (n, 2) left the
client waiting until its timeout.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from ase.calculators.emt import EMT
from ase.calculators.socketio import SocketIOCalculator
from ase.io import write

from rootstock import RootstockCalculator
from rootstock.errors import UsageError, WorkerDiedError, WorkerError, WorkerTimeout
from tests.integration.conftest import process_group
from tests.integration.structures import cu

# The first test also waits for the session's env build (real uv), hence 600 s.
pytestmark = pytest.mark.timeout(600)

CHECKPOINT = "malformed-results"
# Far below the 1800 s default: a result that hangs the client must show here.
CALL_TIMEOUT = 30.0
PROMPT_S = 15.0


@pytest.fixture(autouse=True)
def _isolated_worker(monkeypatch, tmp_path_factory):
    """Private compiler caches and captured worker output (no fake_built_root needed)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "user-cache"))
    monkeypatch.delenv("ROOTSTOCK_WORKER_LOG", raising=False)
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)


def emt(atoms):
    ref = atoms.copy()
    ref.calc = EMT()
    return ref


def calculator(root: Path, **kwargs) -> RootstockCalculator:
    kwargs.setdefault("timeout", CALL_TIMEOUT)
    return RootstockCalculator(root=root, checkpoint=CHECKPOINT, device="cpu", **kwargs)


def ask(atoms, prop: str):
    """Ask for the property a case breaks (the energy for energy-like ones)."""
    if prop == "stress":
        return atoms.get_stress()
    if prop == "charges":
        return atoms.get_charges()
    if prop == "forces":
        return atoms.get_forces()
    return atoms.get_potential_energy()


def assert_good_call(atoms) -> None:
    """A well-formed call on the same warm worker gives EMT's numbers."""
    ref = emt(atoms)
    assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-10)
    np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), rtol=0, atol=1e-10)


# (property, how it is broken, what the message must say); 8 atoms.
MALFORMED = [
    ("forces", "n4", "forces have shape (8, 4), expected (8, 3)"),
    ("forces", "n2", "forces have shape (8, 2), expected (8, 3)"),
    ("forces", "scalar", "forces have shape (), expected (8, 3)"),
    ("forces", "flat", "forces have shape (24,), expected (8, 3)"),
    ("forces", "string", "forces is a string"),
    ("energy", "string", "energy is a string"),
    ("energy", "object", "energy is object with shape ()"),
    ("energy", "vector", "energy has shape (2,), expected a single number"),
    ("stress", "len5", "stress has shape (5,), expected (6,)"),
    ("stress", "4x4", "stress has shape (4, 4), expected (6,)"),
    ("free_energy", "string", "free_energy is a string"),
    ("charges", "object", "'charges' is not numeric"),
]


@pytest.mark.parametrize(
    ("prop", "kind", "text"), MALFORMED, ids=[f"{p}-{k}" for p, k, _ in MALFORMED]
)
def test_a_malformed_result_fails_at_once_and_the_worker_stays_up(malformed_root, prop, kind, text):
    atoms = cu(seed=3)
    with calculator(malformed_root) as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        pid = calc.worker_pid
        atoms.info["malformed"] = {prop: kind}
        atoms.positions[0, 0] += 0.01
        started = time.monotonic()
        with pytest.raises(WorkerError) as caught:
            ask(atoms, prop)
        assert time.monotonic() - started < PROMPT_S
        err = caught.value
        assert not isinstance(err, WorkerDiedError | WorkerTimeout), str(err)
        assert text in err.message, str(err)
        assert "cannot be used" in err.message and "still running" in err.hint
        del atoms.info["malformed"]
        assert_good_call(atoms)
        assert calc.worker_pid == pid


def test_the_public_path_of_a_calculator_with_its_own_plumbing_is_checked(malformed_root):
    atoms = cu(seed=3)
    with calculator(malformed_root, setup_kwargs={"own_plumbing": True}) as calc:
        atoms.calc = calc
        for prop, kind, text in (MALFORMED[0], MALFORMED[8]):
            atoms.info["malformed"] = {prop: kind}
            with pytest.raises(WorkerError, match=text.replace("(", r"\(").replace(")", r"\)")):
                ask(atoms, prop)
        del atoms.info["malformed"]
        assert_good_call(atoms)


def test_a_3x3_stress_stays_valid(malformed_root):
    """matgl returns its stress as a 3x3 matrix."""
    atoms = cu(seed=3)
    atoms.info["malformed"] = {"stress": "3x3"}
    with calculator(malformed_root) as calc:
        atoms.calc = calc
        ref = emt(atoms)
        np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), rtol=0, atol=1e-10)


NONFINITE = [
    ("energy", "nan", "energy is nan"),
    ("energy", "inf", "energy is inf"),
    ("forces", "nan", "forces[0, 1] is nan"),
    ("stress", "inf", "stress[1, 1] is inf"),
]


@pytest.mark.parametrize(
    ("prop", "kind", "text"), NONFINITE, ids=[f"{p}-{k}" for p, k, _ in NONFINITE]
)
def test_nan_or_inf_is_an_error_unless_allowed(malformed_root, prop, kind, text):
    atoms = cu(seed=3)
    atoms.info["malformed"] = {prop: kind}
    with calculator(malformed_root) as calc:
        atoms.calc = calc
        with pytest.raises(WorkerError) as caught:
            ask(atoms, prop)
        err = caught.value
        assert not isinstance(err, WorkerDiedError | WorkerTimeout), str(err)
        assert text in err.message, str(err)
        assert "allow_nonfinite=True" in err.hint
        del atoms.info["malformed"]
        assert_good_call(atoms)
    atoms.info["malformed"] = {prop: kind}
    with calculator(malformed_root, allow_nonfinite=True) as calc:
        atoms.calc = calc
        value = np.asarray(ask(atoms, prop), dtype=float)
        assert not np.isfinite(value).all()
        assert np.isfinite(atoms.get_forces()).all() or prop == "forces"


def test_allow_nonfinite_must_be_a_bool(malformed_root):
    with pytest.raises(UsageError, match="allow_nonfinite"):
        calculator(malformed_root, allow_nonfinite="yes")


def test_rootstock_serve_closes_the_connection_on_a_malformed_result(malformed_root, tmp_path):
    """Standard i-PI has no error frame: the driver must stop, not integrate garbage."""
    atoms = cu(seed=3)
    structure = tmp_path / "start.xyz"
    write(structure, atoms, format="extxyz")
    name = f"rootstock-test-{uuid.uuid4().hex[:12]}"
    argv = [
        sys.executable, "-m", "rootstock.cli.main", "serve", CHECKPOINT,
        "--socket", f"/tmp/ipi_{name}", "--structure", str(structure),
        "--root", str(malformed_root), "--device", "cpu", "--connect-timeout", "60",
        "--kwarg", "forces=n4",
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with (
        SocketIOCalculator(unixsocket=name, timeout=60) as driver,
        open(log, "wb") as out,
        process_group(argv, stdout=out, stderr=subprocess.STDOUT) as serve,
    ):
        atoms.calc = driver
        with pytest.raises(Exception):  # noqa: B017 - ASE reports a closed socket its own way
            atoms.get_forces()
        code = serve.wait(timeout=30)
    output = log.read_text()
    assert code != 0, output
    assert "forces have shape (8, 4), expected (8, 3)" in output
    assert "closing the connection" in output
