"""Seven NEB images on CHGNet share one worker (the calculators are deep copies,
as quacc's NEB runner makes them), and what that saves in memory.

A vacancy hop in a 15-atom Cu cell; one NEB force evaluation, not a converged
band. The shared worker's resident memory is printed (and recorded as a property)
next to that of one unshared worker for the same checkpoint: seven unshared
images would hold seven of those.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

from tests.integration.killing import worker_children

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1200)]

CHECKPOINT = "chgnet-0.3.0"
IMAGES = 7


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` (VmRSS), in MiB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def vacancy_hop():
    from ase.build import bulk

    initial = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 1)
    del initial[0]  # the vacancy at the origin
    final = initial.copy()
    hop = int(np.argmin(np.linalg.norm(initial.positions - [0.0, 1.8, 1.8], axis=1)))
    final.positions[hop] = [0.0, 0.0, 0.0]
    return initial, final


def test_seven_chgnet_neb_images_use_one_worker(family_env, record_property):
    from ase.mep import NEB

    from rootstock import RootstockCalculator

    root = family_env("chgnet")
    started = time.monotonic()
    template = RootstockCalculator(root=root, checkpoint=CHECKPOINT, device="cpu")
    initial, final = vacancy_hop()
    images = [initial] + [initial.copy() for _ in range(IMAGES - 2)] + [final]
    for image in images:
        image.calc = copy.deepcopy(template)
    alone = RootstockCalculator(root=root, checkpoint=CHECKPOINT, device="cpu", shared=False)
    try:
        neb = NEB(images, method="improvedtangent")
        neb.interpolate()
        energies = [image.get_potential_energy() for image in (images[0], images[-1])]
        forces = neb.get_forces()
        assert forces.shape == ((IMAGES - 2) * len(initial), 3)
        assert np.isfinite(forces).all() and np.isfinite(energies).all()
        pids = {image.calc.worker_pid for image in images}
        assert len(pids) == 1 and None not in pids, pids
        (pid,) = pids
        assert worker_children(root) == [pid]
        shared_rss = rss_mib(pid)

        probe = images[3].copy()
        probe.calc = alone
        assert probe.get_potential_energy() == pytest.approx(
            images[3].get_potential_energy(), rel=1e-5
        )
        assert alone.worker_pid not in (None, pid)
        assert sorted(worker_children(root)) == sorted([pid, alone.worker_pid])
        alone_rss = rss_mib(alone.worker_pid)
    finally:
        alone.close()
        for image in images:
            image.calc.close()
        template.close()
    record_property("shared_worker_rss_mib", round(shared_rss, 1))
    record_property("unshared_worker_rss_mib", round(alone_rss, 1))
    print(
        f"{IMAGES} CHGNet NEB images on one shared worker: {shared_rss:.0f} MiB RSS; "
        f"one unshared worker: {alone_rss:.0f} MiB, so {IMAGES} unshared would hold "
        f"about {IMAGES * alone_rss:.0f} MiB ({time.monotonic() - started:.0f} s after the build)"
    )
