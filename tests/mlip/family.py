"""What the model-family tests share: run a model in its env's own Python, or through
RootstockCalculator, on the same structure, and compare.

Every family test follows one pattern:

1. ``built = family_env("mace")`` builds ``environments/mace.py`` into the session's
   family root once (real uv, the local CPU torch wheel);
2. for a family whose wheel ships no weights, ``run_in_env(root, env, SCRIPT, out)``
   builds a small randomly initialised model in the env's own Python and saves it;
3. ``through_calculator(...)`` and ``in_process(...)`` compute energy, forces and
   stress on :func:`structure` (and any ASE extras the model filled), and
   ``assert_agree`` compares them;
4. :func:`rootstock.ops.consistency.check_consistency` runs through the same
   calculator, so a unit or sign error fails the family test.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

THREADS = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
EXTRA_PROPERTIES = ("magmoms", "charges", "energies", "dipole")

IN_PROCESS = textwrap.dedent("""
    import importlib.util, json, sys
    import numpy as np
    try:
        import torch
        torch.set_num_threads(2)
    except ImportError:
        pass
    from ase import Atoms
    request = json.loads(sys.argv[2])
    spec = importlib.util.spec_from_file_location("env_source", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules["env_source"] = module
    spec.loader.exec_module(module)
    s = request["structure"]
    atoms = Atoms(symbols=s["symbols"], positions=s["positions"], cell=s["cell"], pbc=s["pbc"])
    kwargs = request["kwargs"]
    if request["weights"] is not None:
        calc = module.setup_from_path(request["weights"], device=request["device"], **kwargs)
    else:
        calc = module.setup(request["checkpoint"], device=request["device"], **kwargs)
    atoms.calc = calc
    out = {"energy": float(atoms.get_potential_energy()),
           "forces": np.asarray(atoms.get_forces(), dtype=float).tolist()}
    if atoms.pbc.all():
        out["stress"] = np.asarray(atoms.get_stress(), dtype=float).tolist()
    for name in request["extras"]:
        value = calc.results.get(name)
        if value is not None:
            out[name] = np.asarray(value, dtype=float).tolist()
    print("ROOTSTOCK-RESULT " + json.dumps(out))
""")


def env_python(root: Path, env: str) -> Path:
    """The built env's own interpreter."""
    return root / "envs" / env / "bin" / "python"


def env_run_environment() -> dict[str, str]:
    """What a model run in an env's Python gets: same threads as the worker, no hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **THREADS, "HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}


def run_in_env(root: Path, env: str, script: str, *args: Any, timeout: float = 600) -> str:
    """Run ``script`` (Python source) in ``env``'s Python; return its stdout.

    Used to build a random model of the family and save it where the test wants it.
    Fails the test with the script's output if it exits non-zero.
    """
    proc = subprocess.run(
        [env_python(root, env), "-c", textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_run_environment(),
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"script in env {env} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc.stdout


def structure(seed: int = 3):
    """32 Cu atoms: a cubic fcc 2x2x2 supercell, rattled (the family tests' structure)."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=seed)
    return atoms


def _structure_json(atoms) -> dict[str, Any]:
    return {
        "symbols": atoms.get_chemical_symbols(),
        "positions": atoms.get_positions().tolist(),
        "cell": atoms.get_cell().array.tolist(),
        "pbc": atoms.pbc.tolist(),
    }


def in_process(
    root: Path,
    env: str,
    *,
    checkpoint: str | None = None,
    weights: Path | None = None,
    kwargs: dict[str, Any] | None = None,
    atoms=None,
    device: str = "cpu",
    extras: tuple[str, ...] = EXTRA_PROPERTIES,
    timeout: float = 900,
) -> dict[str, Any]:
    """The same model run in the env's own Python, calling ``setup()`` directly.

    ``weights`` calls ``setup_from_path(weights)`` instead of ``setup(checkpoint)``.
    """
    request = {
        "checkpoint": checkpoint,
        "weights": str(weights) if weights is not None else None,
        "kwargs": kwargs or {},
        "device": device,
        "structure": _structure_json(atoms if atoms is not None else structure()),
        "extras": list(extras),
    }
    source = root / "envs" / env / "env_source.py"
    out = run_in_env(root, env, IN_PROCESS, source, json.dumps(request), timeout=timeout)
    line = next(x for x in reversed(out.splitlines()) if x.startswith("ROOTSTOCK-RESULT "))
    return json.loads(line.removeprefix("ROOTSTOCK-RESULT "))


def _energy_forces_stress(atoms) -> dict[str, Any]:
    return {
        "energy": atoms.get_potential_energy(),
        "forces": atoms.get_forces(),
        "stress": atoms.get_stress(),
    }


def through_calculator(
    root: Path,
    checkpoint: str,
    *,
    weights: Path | None = None,
    setup_kwargs: dict[str, Any] | None = None,
    atoms=None,
    extras: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Energy, forces, stress (and the named ``extras``) through RootstockCalculator."""
    from rootstock import RootstockCalculator

    atoms = atoms if atoms is not None else structure()
    with RootstockCalculator(
        root=root, checkpoint=checkpoint, device="cpu", weights=weights, setup_kwargs=setup_kwargs
    ) as calc:
        atoms.calc = calc
        out = _energy_forces_stress(atoms)
        for name in extras:
            out[name] = atoms.calc.get_property(name, atoms)
    return out


def assert_agree(ours: dict[str, Any], reference: dict[str, Any], rtol: float = 1e-6) -> None:
    """Energy, forces and stress agree to ``rtol`` (relative to each array's scale)."""
    assert ours["energy"] == pytest.approx(reference["energy"], rel=rtol)
    for name in ("forces", "stress"):
        ref = np.asarray(reference[name])
        scale = float(np.abs(ref).max()) or 1.0
        np.testing.assert_allclose(ours[name], ref, rtol=rtol, atol=rtol * scale)


def agreement(ours: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """The largest relative differences (for the closing note and docs/models.md)."""
    figures = {"energy": abs(ours["energy"] - reference["energy"]) / abs(reference["energy"])}
    for name in ("forces", "stress"):
        ref = np.asarray(reference[name])
        scale = float(np.abs(ref).max()) or 1.0
        figures[name] = float(np.abs(np.asarray(ours[name]) - ref).max() / scale)
    return figures


def session_with_check(
    root: Path,
    checkpoint: str,
    *,
    dtype: str,
    weights: Path | None = None,
    setup_kwargs: dict[str, Any] | None = None,
    modes: dict[str, str] | None = None,
    atoms=None,
):
    """Energy, forces and stress, then the physics check, in one calculator session.

    Returns ``(results, ConsistencyReport)``: the check runs through the very
    calculator that computed the results, as verification does.
    """
    from rootstock import RootstockCalculator
    from rootstock.ops.consistency import check_consistency

    atoms = atoms if atoms is not None else structure()
    with RootstockCalculator(
        root=root, checkpoint=checkpoint, device="cpu", weights=weights, setup_kwargs=setup_kwargs
    ) as calc:
        atoms.calc = calc
        results = _energy_forces_stress(atoms)
        report = check_consistency(atoms, calc, dtype=dtype, modes=modes)
    return results, report


def ratios(report) -> str:
    """A consistency report's ratios, for assertion messages."""
    return ", ".join(f"{name} ratio {check.ratio}" for name, check in report.checks.items())
