"""calculate_batch streams: 100,000 structures from a generator through the null model
grow the client's peak RSS by less than 50 MB.

The client runs in a subprocess of the dev interpreter, so that pytest's own memory
(and what earlier tests left behind) cannot hide or fake the growth; the baseline
is taken after a first batch, once the imports and the worker start are paid for.
The growth includes the returned list itself (100,000 small dicts, about 20 MB):
what must not grow with the input is everything else.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import process_group

# The first test of a module may wait for the session's env builds (real uv).
pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(900)]

COUNT = 100_000
LIMIT_MB = 50.0

CLIENT = """
import json, resource, sys, time

import numpy as np
from ase import Atoms

from rootstock import RootstockCalculator

root, count = sys.argv[1], int(sys.argv[2])


def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def structures(n):
    rng = np.random.default_rng(0)
    for i in range(n):
        natoms = 1 + i % 2
        yield Atoms(
            numbers=[1] * natoms, positions=rng.random((natoms, 3)) * 3, cell=[4, 4, 4], pbc=True
        )


with RootstockCalculator("null", root=root, device="cpu", timeout=120) as calc:
    calc.calculate_batch(structures(200), properties=("energy",))
    # Start the peak afresh: Linux resets VmHWM on "5", so a transient peak during
    # the imports cannot hide growth. ru_maxrss cannot be reset (it also keeps the
    # peak of threads that have ended), so it is only the fallback.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base, source = peak_kib(), "VmHWM"
    except OSError:
        base, source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    start = time.perf_counter()
    results = calc.calculate_batch(structures(count), properties=("energy",))
    seconds = time.perf_counter() - start
    peak = peak_kib() if source == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wrong = [i for i, r in enumerate(results) if r["energy"] != -1.0 * (1 + i % 2)]
print(json.dumps({"count": len(results), "wrong": wrong[:5], "seconds": seconds,
                  "growth_mb": (peak - base) / 1024.0, "measured_by": source}))
"""


def test_a_hundred_thousand_structures_stream_in_bounded_client_memory(fake_built_root: Path):
    argv = [sys.executable, "-c", CLIENT, str(fake_built_root), str(COUNT)]
    with process_group(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    print(f"batch memory: {report}")
    assert report["count"] == COUNT and report["wrong"] == []
    assert report["growth_mb"] < LIMIT_MB, report
