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

Every start of an env's Python or of a worker imports torch and the family (seconds
of CPU on two cores, and the run shares those cores among its xdist workers), so a
module starts as few as its tests need: ``in_process_models(..., build=(SCRIPT,
[out]))`` saves the random model and then runs it (and other models of the env)
in-process in one start, and module-scoped fixtures hold results that several
tests check.
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

#: One thread for every worker and every run in an env's Python. Under scripts/test the
#: run's xdist workers share two cores, so a second torch thread only adds OpenMP
#: threads that spin at barriers waiting for a core: measured over tests/mlip on four
#: workers (2026-12-05), 807 CPU-s and 412 s with two threads, 386 CPU-s and 205 s
#: with one. One thread also sums in one fixed order.
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
EXTRA_PROPERTIES = ("magmoms", "charges", "energies", "dipole")

IN_PROCESS = textwrap.dedent("""
    import importlib.util, json, os, sys
    import numpy as np
    try:
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
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
    results = []
    for model in request["models"]:
        kwargs = model["kwargs"]
        if model["weights"] is not None:
            calc = module.setup_from_path(model["weights"], device=model["device"], **kwargs)
        else:
            calc = module.setup(model["checkpoint"], device=model["device"], **kwargs)
        work = atoms.copy()
        work.calc = calc
        out = {"energy": float(work.get_potential_energy()),
               "forces": np.asarray(work.get_forces(), dtype=float).tolist()}
        if work.pbc.all():
            out["stress"] = np.asarray(work.get_stress(), dtype=float).tolist()
        for name in request["extras"]:
            value = calc.results.get(name)
            if value is not None:
                out[name] = np.asarray(value, dtype=float).tolist()
        results.append(out)
    print("ROOTSTOCK-RESULT " + json.dumps(results))
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


def built_first(script: str, args: list[Any]) -> str:
    """Python source that runs ``script`` as :func:`run_in_env` would with ``args``, then
    puts ``sys.argv`` back: put before another in-env script, it builds and saves a
    random model in the same run of the env's Python, which saves an interpreter and an
    import of the family (seconds on two cores). The script after it still loads the
    model from the saved file, through ``setup_from_path`` as the worker does."""
    argv = [str(arg) for arg in args]
    return textwrap.dedent(f"""
        import sys as _sys
        _argv = _sys.argv
        _sys.argv = [_argv[0], *{argv!r}]
        exec(compile({textwrap.dedent(script)!r}, "<build>", "exec"), {{"__name__": "__main__"}})
        _sys.argv = _argv
        del _sys, _argv
    """)


def structure(seed: int = 3):
    """32 Cu atoms: a cubic fcc 2x2x2 supercell, rattled (the family tests' structure)."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=seed)
    return atoms


def small_structure(seed: int = 3):
    """8 Cu atoms: the fcc primitive cell 2x2x2, rattled (for a model whose every call
    is dear on two cores: ORB's full-size orb-v3)."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6) * (2, 2, 2)
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
    model = model_request(checkpoint=checkpoint, weights=weights, kwargs=kwargs, device=device)
    (result,) = in_process_models(root, env, [model], atoms=atoms, extras=extras, timeout=timeout)
    return result


def model_request(
    *,
    checkpoint: str | None = None,
    weights: Path | None = None,
    kwargs: dict[str, Any] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """One model for :func:`in_process_models`: ``setup(checkpoint)`` or, given
    ``weights``, ``setup_from_path(weights)``, with ``kwargs``."""
    return {
        "checkpoint": checkpoint,
        "weights": str(weights) if weights is not None else None,
        "kwargs": kwargs or {},
        "device": device,
    }


def in_process_models(
    root: Path,
    env: str,
    models: list[dict[str, Any]],
    *,
    atoms=None,
    extras: tuple[str, ...] = EXTRA_PROPERTIES,
    build: tuple[str, list[Any]] | None = None,
    timeout: float = 900,
) -> list[dict[str, Any]]:
    """:func:`in_process` for several models of one env (:func:`model_request`), one
    after the other in one run of the env's Python: one interpreter and import instead
    of one per model. Each model gets a fresh copy of the structure.

    ``build=(script, args)`` first runs a script that saves a random model (as
    :func:`run_in_env` would), in the same run: see :func:`built_first`.
    """
    request = {
        "models": models,
        "structure": _structure_json(atoms if atoms is not None else structure()),
        "extras": list(extras),
    }
    script = IN_PROCESS if build is None else built_first(*build) + IN_PROCESS
    source = root / "envs" / env / "env_source.py"
    out = run_in_env(root, env, script, source, json.dumps(request), timeout=timeout)
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
