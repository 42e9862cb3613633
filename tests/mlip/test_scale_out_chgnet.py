"""CHGNet through ``rootstock.evaluate`` on a Dask LocalCluster of 2 workers.

The one scale-out test on a real model (the others use EMT): 8 rattled 8-atom Cu
cells in chunks of 2 go to a LocalCluster bound to 127.0.0.1, and must give what
an in-process ``calculate_batch`` gives on the same checkpoint with the same
chunks, with one model load per engine worker.

Model loads are counted as the Rootstock worker processes below each Dask worker
process (a worker calls the env's ``setup()`` once), and as the entries of each
worker's plugin cache.

Tolerance: CHGNet runs float32. Both sides run the same chunks in the same kind
of worker with the same threads (OMP_NUM_THREADS=1 from tests/mlip/conftest.py),
so they should agree to rounding; the bound is 1e-6 relative to the largest value
of each quantity in the batch, about 8 float32 ulps, far below the 1e-3 bound
CHGNet's batched call is held to in test_batch_hooks.py. Measured here (2 cores,
2026-12-02): energy, forces and stress differ by exactly 0.

Runtime beyond the CHGNet env build: 33 s on two cores at load average ~4 (two
model loads on the cluster, one in-process); the env build is shared with the
other CHGNet tests (BATCH_TEST_FAMILIES in tests/conftest.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.killing import live_descendants

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(600)]

CHECKPOINT = "chgnet-0.3.0"
CELLS, CHUNK, WORKERS = 8, 2, 2
RTOL = 1e-6


def rattled_cells(count: int) -> list:
    """``count`` fcc Cu 2x2x2 primitive cells (8 atoms), each rattled 0.05 Å by its seed."""
    from ase.build import bulk

    base = bulk("Cu", "fcc", a=3.6) * (2, 2, 2)
    images = []
    for seed in range(count):
        atoms = base.copy()
        atoms.rattle(0.05, seed=seed)
        images.append(atoms)
    return images


def rootstock_workers_below(pid: int) -> list[int]:
    """The live ``python -m rootstock.worker`` processes below ``pid``."""
    found = []
    for child in live_descendants(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rootstock.worker" in argv:
            found.append(child)
    return found


def largest_relative_difference(got: list[dict], want: list[dict], name: str) -> float:
    a = np.array([r[name] for r in got], dtype=float)
    b = np.array([r[name] for r in want], dtype=float)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_chgnet_on_dask_matches_calculate_batch_with_one_load_per_worker(family_env):
    import rootstock
    from rootstock import RootstockCalculator
    from rootstock.parallel import dask_local_client

    root = family_env("chgnet")
    images = rattled_cells(CELLS)
    options = {"root": root, "shared": False, "pool": False}
    with RootstockCalculator(CHECKPOINT, device="cpu", **options) as calc:
        want = calc.calculate_batch(images, batch_size=CHUNK)
    assert rootstock_workers_below(os.getpid()) == []  # the in-process one is gone

    client = dask_local_client(workers=WORKERS, address="127.0.0.1")
    cluster = client.cluster
    try:
        info = client.scheduler_info()
        assert info["address"].startswith("tcp://127.0.0.1:"), info["address"]
        assert len(info["workers"]) == WORKERS
        assert all(a.startswith("tcp://127.0.0.1:") for a in info["workers"]), info["workers"]
        got = rootstock.evaluate(
            images, CHECKPOINT, device="cpu", executor=client, batch_size=CHUNK,
            start_timeout=120, **options,
        )  # fmt: skip
        engine_pids = client.run(os.getpid)
        loads = {addr: rootstock_workers_below(pid) for addr, pid in engine_pids.items()}
        caches = client.run(lambda dask_worker: len(dask_worker.plugins["rootstock"].cache))
    finally:
        client.close()
        cluster.close()

    assert len(got) == CELLS
    diffs = {n: largest_relative_difference(got, want, n) for n in ("energy", "forces", "stress")}
    print(f"largest relative differences from calculate_batch: {diffs}")
    assert all(d <= RTOL for d in diffs.values()), diffs
    # One model load per engine worker: each Dask worker holds exactly one Rootstock
    # worker (and one warm calculator), so 4 chunks made 2 loads, not 4.
    assert sorted(len(pids) for pids in loads.values()) == [1] * WORKERS, loads
    assert sorted(caches.values()) == [1] * WORKERS, caches
    deadline = time.monotonic() + 30  # each Rootstock worker ends with its Dask worker
    while rootstock_workers_below(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rootstock_workers_below(os.getpid()) == []
