"""The in-env side of ``benchmarks/throughput.py``: the model without Rootstock.

Run by an env's own Python (stdlib, numpy, ase and the model's library only):

    python _throughput_env.py ENV_SOURCE CHECKPOINT DEVICE STRUCTURES.npz

It calls the env's ``setup()`` once, then times on command, so that the
benchmark can take turns between this process and its own calculators:

- ``{"run": "loop"}``: energy, forces and stress one structure at a time through
  the calculator ``setup()`` returned (the model's own loop);
- ``{"run": "batch", "batch_size": B}``: the library's own batched call, where it
  has one (CHGNet's ``predict_structure``), Atoms-to-input conversion included.

Each command gets one JSON line back on the original stdout; anything the model
prints goes to stderr, so it cannot corrupt the replies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from typing import Any

import numpy as np
from ase import Atoms


def load_structures(path: str) -> list[Atoms]:
    data = np.load(path)
    return [
        Atoms(numbers=numbers, positions=positions, cell=cell, pbc=True)
        for numbers, positions, cell in zip(
            data["numbers"], data["positions"], data["cells"], strict=True
        )
    ]


def load_env(source: str) -> Any:
    spec = importlib.util.spec_from_file_location("env_source", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules["env_source"] = module
    spec.loader.exec_module(module)
    return module


def own_loop(calc: Any, images: list[Atoms]) -> tuple[float, list[float]]:
    energies = []
    start = time.perf_counter()
    for atoms in images:
        atoms.calc = calc
        energies.append(float(atoms.get_potential_energy()))
        atoms.get_forces()
        atoms.get_stress()
    elapsed = time.perf_counter() - start
    for atoms in images:
        atoms.calc = None  # the next turn must compute again, not read a cache
    return elapsed, energies


def chgnet_batch(calc: Any, images: list[Atoms], batch_size: int) -> tuple[float, list[float]]:
    from pymatgen.io.ase import AseAtomsAdaptor

    model = calc.model
    predictions = []
    start = time.perf_counter()
    # One call per chunk of batch_size, as calculate_batch sends them: a single call
    # over all of them holds every batch's graphs at once (gigabytes for Cu8 cells).
    for first in range(0, len(images), batch_size):
        chunk = images[first : first + batch_size]
        structures = [AseAtomsAdaptor.get_structure(atoms) for atoms in chunk]
        predicted = model.predict_structure(structures, batch_size=batch_size)
        predictions += [predicted] if isinstance(predicted, dict) else predicted
    elapsed = time.perf_counter() - start
    # CHGNet predicts eV per atom.
    energies = [float(p["e"]) * len(a) for p, a in zip(predictions, images, strict=True)]
    return elapsed, energies


def batched_call(calc: Any) -> tuple[str | None, Any]:
    """The library's own batched call for this calculator, or None."""
    if hasattr(getattr(calc, "model", None), "predict_structure"):
        return "chgnet.predict_structure", chgnet_batch
    return None, None


def main() -> None:
    source, checkpoint, device, structures = sys.argv[1:5]
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the model's prints go to stderr
    sys.stdout = sys.stderr
    images = load_structures(structures)
    start = time.perf_counter()
    calc = load_env(source).setup(checkpoint, device=device)
    own_loop(calc, images[:2])  # first-call costs (lazy imports, JIT) are not timed
    setup_s = time.perf_counter() - start
    name, batch = batched_call(calc)
    if batch is not None:
        batch(calc, images[:4], 4)
    replies.write(json.dumps({"ready": True, "setup_s": setup_s, "batched": name}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command["run"] == "loop":
            seconds, energies = own_loop(calc, images)
        elif command["run"] == "batch" and batch is not None:
            seconds, energies = batch(calc, images, int(command["batch_size"]))
        else:
            replies.write(json.dumps({"error": f"cannot run {command!r}"}) + "\n")
            continue
        replies.write(json.dumps({"seconds": seconds, "energies": energies}) + "\n")


if __name__ == "__main__":
    main()
