"""One client process of ``benchmarks/coalescing.py``: single calls to a pooled worker.

    python _coalescing_client.py ROOT CHECKPOINT DEVICE CELLS.npz FIRST COUNT OUT.npz

It attaches to the pooled worker (``pool=True``), makes one untimed warm-up call,
prints ``{"ready": true}`` and waits for a ``go`` line on stdin, so that the
benchmark starts every client together once all of them are attached. Then it asks
for the energy and forces of structures FIRST .. FIRST+COUNT-1 of CELLS.npz, one
call each, saves the energies and forces to OUT.npz and prints one JSON line: its
start and end (``time.monotonic()``, which is one clock for every process of the
machine) and each call's latency in seconds.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from ase import Atoms


def load_structures(path: str, first: int, count: int) -> list[Atoms]:
    """Structures FIRST .. FIRST+COUNT-1 of the benchmark's cells file."""
    data = np.load(path)
    window = slice(first, first + count)
    return [
        Atoms(numbers=numbers, positions=positions, cell=cell, pbc=True)
        for numbers, positions, cell in zip(
            data["numbers"][window], data["positions"][window], data["cells"][window], strict=True
        )
    ]


def main() -> None:
    root, checkpoint, device, cells, first, count, out = sys.argv[1:8]
    from rootstock import RootstockCalculator

    images = load_structures(cells, int(first), int(count))
    calc = RootstockCalculator(checkpoint, root=root, device=device, pool=True, timeout=600.0)
    try:
        warm = images[0].copy()
        warm.positions += 0.01  # not the first timed structure, which must be computed
        warm.calc = calc
        warm.get_potential_energy()
        warm.get_forces()
        print(json.dumps({"ready": True}), flush=True)
        if sys.stdin.readline().strip() != "go":
            return  # the benchmark gave up before the start
        energies, forces, latencies = [], [], []
        start = time.monotonic()
        for atoms in images:
            before = time.monotonic()
            atoms.calc = calc
            energies.append(atoms.get_potential_energy())
            forces.append(atoms.get_forces())  # the same reply: no second round trip
            latencies.append(time.monotonic() - before)
        end = time.monotonic()
    finally:
        calc.close()
    np.savez(out, energies=np.array(energies), forces=np.array(forces))
    print(json.dumps({"start": start, "end": end, "latencies_s": latencies}), flush=True)


if __name__ == "__main__":
    main()
