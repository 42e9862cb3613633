"""The in-env half of ``rootstock benchmark``: the same walk, calling ``setup()`` directly.

``rootstock benchmark`` runs this file *by path* with the env's own interpreter and
the environment a worker gets, so it must import nothing but the standard library,
numpy, ASE and ``rootstock.worker`` (which every env has, in whatever rootstock
version it was built with; this file may be newer than that wheel). The client
imports it too, for :func:`walk_steps`, so both halves walk exactly the same path.

    python -I probe.py REQUEST.json RESULT.json

The request names the env source, checkpoint, device, setup keywords, weights,
the system and the walk; the result holds the timings, every energy and the last
forces.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

WALK_SEED = 42
WALK_STEP = 0.005  # Å moved by every atom at every step


def walk_steps(
    natoms: int, steps: int, seed: int = WALK_SEED, step: float = WALK_STEP
) -> Iterator[Any]:
    """Yield ``steps`` displacement arrays ``(natoms, 3)``: every atom moves ``step`` Å.

    The directions come from the raw PCG64 stream (stable across numpy versions,
    unlike ``Generator`` methods), turned into floats here, so the client and an
    env with another numpy compute bit-identical geometries.
    """
    bits = np.random.PCG64(seed)
    for _ in range(steps):
        raw = bits.random_raw(natoms * 3).reshape(natoms, 3)
        uniform = (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
        vec = 2.0 * uniform - 1.0
        norm = np.sqrt(vec[:, 0] * vec[:, 0] + vec[:, 1] * vec[:, 1] + vec[:, 2] * vec[:, 2])
        norm[norm == 0.0] = 1.0
        yield vec * (step / norm)[:, None]


def walk(atoms: Any, steps: int, seed: int = WALK_SEED) -> Iterator[int]:
    """Yield 0..steps, moving ``atoms`` one walk step before every index after 0."""
    yield 0
    for index, delta in enumerate(walk_steps(len(atoms), steps, seed), start=1):
        atoms.positions = atoms.positions + delta
        yield index


def one_call(atoms: Any, periodic: bool) -> tuple[float, Any]:
    """Energy, forces (and stress on a periodic cell), as a user script asks for them."""
    energy = float(atoms.get_potential_energy())
    forces = atoms.get_forces()
    if periodic:
        atoms.get_stress()
    return energy, forces


def atoms_from(system: dict[str, Any]) -> Any:
    """ASE Atoms from the request's ``numbers``, ``positions``, ``cell``, ``pbc``, ``arrays``."""
    from ase import Atoms

    atoms = Atoms(
        numbers=system["numbers"],
        positions=system["positions"],
        cell=system["cell"],
        pbc=system["pbc"],
    )
    for name, values in (system.get("arrays") or {}).items():
        atoms.set_array(name, np.asarray(values, dtype=np.float64))
    return atoms


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Load the model as the worker does, then time the walk; the result document."""
    from rootstock.worker.model import load_env_source, make_calculator

    started = time.monotonic()
    module = load_env_source(request["env_source"])
    calc = make_calculator(
        module,
        request["checkpoint"],
        request["device"],
        dict(request.get("setup_kwargs") or {}),
        request.get("weights"),
    )
    setup_done = time.monotonic()
    atoms = atoms_from(request["system"])
    periodic = bool(request["system"]["periodic"])
    atoms.calc = calc
    warmup, calls = int(request["warmup"]), int(request["calls"])
    energies: list[float] = []
    times: list[float] = []
    forces = None
    first_done = started
    for index in walk(atoms, warmup + calls, int(request["seed"])):
        tick = time.perf_counter()
        energy, forces = one_call(atoms, periodic)
        elapsed = time.perf_counter() - tick
        energies.append(energy)
        if index == 0:
            first_done = time.monotonic()
        elif index > warmup:
            times.append(elapsed)
    return {
        "first_call_done": first_done,  # time.monotonic(): one clock for every process
        "setup_s": setup_done - started,
        "first_call_s": first_done - setup_done,
        "times_s": times,
        "energies": energies,
        "last_forces": np.asarray(forces, dtype=float).tolist(),
    }


def main(argv: list[str]) -> int:
    """Read the request, run it, write the result; a failure exits 1 with a traceback."""
    if len(argv) != 2:
        print("usage: python -I benchmark_probe.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        request = json.load(fh)
    result = run(request)
    with open(argv[1] + ".part", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(argv[1] + ".part", argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
