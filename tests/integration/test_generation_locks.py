"""A running worker holds its env generation: ``install --force`` never deletes it.

Real uv builds of the EMT sample env, a real worker behind ``RootstockCalculator``,
and real ``lockf`` locks between processes (a lock is per process, so the holder is
always another process than the claimer). Every process a test starts is killed at
teardown.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator
from rootstock.install.generations import GENERATION_LOCK, claim_generation, make_generation_lock
from tests.conftest import ENVIRONMENTS, make_root, run_rootstock
from tests.integration.checkpoint_envs import reap_workers

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("private_config")]

# Holds a shared lockf lock on argv[1] through a read-only descriptor until stdin closes.
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
print("held", flush=True)
sys.stdin.read()
"""


def generation_of(root: Path) -> Path:
    return Path(os.path.realpath(root / "envs" / "emt"))


def reinstall(root: Path) -> str:
    """``install emt.py --force``; its stdout and stderr together."""
    proc = run_rootstock("install", ENVIRONMENTS / "emt.py", "--root", root, "--force")
    return proc.stdout + proc.stderr


def energy_matches_in_process(calc: RootstockCalculator, seed: int) -> None:
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=seed)
    reference = atoms.copy()
    reference.calc = EMT()
    atoms.calc = calc
    assert atoms.get_potential_energy() == pytest.approx(
        reference.get_potential_energy(), abs=1e-10
    )
    np.testing.assert_allclose(atoms.get_forces(), reference.get_forces(), rtol=0, atol=1e-10)


@pytest.fixture
def root(tmp_path: Path, shared_uv_cache: Path) -> Iterator[Path]:
    path = make_root(tmp_path / "root", shared_uv_cache)
    run_rootstock("install", ENVIRONMENTS / "emt.py", "--root", path)
    yield path
    reap_workers(path, grace_s=5)


def test_a_fresh_build_has_a_lock_file_every_user_can_read(root: Path) -> None:
    lock = generation_of(root) / GENERATION_LOCK
    assert lock.is_file() and not lock.is_symlink()
    # World-readable (every user's worker opens it), group-writable (every maintainer
    # claims it), writable by no one else; empty.
    assert lock.stat().st_mode & 0o777 == 0o664
    assert lock.stat().st_size == 0


def test_a_running_worker_keeps_its_generation_through_two_rebuilds(root: Path) -> None:
    first = generation_of(root)
    # A generation from before generation locks: nothing holds it, so it goes as before.
    pre_lock = root / "envs" / ".emt.0123456789abcdef"
    (pre_lock / "bin").mkdir(parents=True)
    calc = RootstockCalculator(root=root, checkpoint="emt", device="cpu")
    try:
        energy_matches_in_process(calc, seed=1)
        pid = calc.worker_pid
        assert pid is not None
        with claim_generation(first) as claimed:
            assert claimed is False, "the worker holds a shared lock on its generation"

        reinstall(root)
        second = generation_of(root)
        assert second != first and first.is_dir()  # the previous build is always kept
        assert not pre_lock.exists()

        output = reinstall(root)
        third = generation_of(root)
        assert third not in (first, second)
        # Older than the previous build, but a worker runs from it: kept, and said so.
        assert first.is_dir() and second.is_dir()
        assert f"kept {first}: a running worker uses it" in output, output
        assert calc.worker_pid == pid
        energy_matches_in_process(calc, seed=2)
    finally:
        calc.close()

    with claim_generation(first) as claimed:
        assert claimed is True, "the closed worker's lock is gone with it"
    output = reinstall(root)
    assert not first.exists() and not second.exists()
    assert "running worker" not in output
    assert generation_of(root).is_dir() and third.is_dir()


# Run by the env's interpreter: import the worker (numpy loads from the generation
# envs/emt points at), swap envs/emt to another generation, then ask which one to hold.
SWAP_THEN_ASK = """
import os, sys
import rootstock.worker.main as worker
link, other = sys.argv[1], sys.argv[2]
tmp = link + ".swap"
os.symlink(os.path.basename(other), tmp)
os.replace(tmp, link)
print(os.path.realpath(sys.prefix))
print(worker._loaded_generation())
"""


def test_the_worker_holds_the_generation_it_loaded_even_after_a_swap(root: Path) -> None:
    loaded = generation_of(root)
    other = root / "envs" / ".emt.0000aaaa0000aaaa"
    other.mkdir()
    link = root / "envs" / "emt"
    try:
        proc = subprocess.run(
            [str(link / "bin" / "python"), "-I", "-c", SWAP_THEN_ASK, str(link), str(other)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    finally:
        tmp = link.with_name("emt.restore")
        tmp.symlink_to(loaded.name)
        os.replace(tmp, link)
    prefix, held = proc.stdout.split()
    assert prefix == str(other)  # sys.prefix now resolves to the swapped-in directory
    assert held == str(loaded)  # but numpy was mapped from the one it started in


def test_a_shared_lock_on_a_read_only_descriptor_blocks_the_claim(tmp_path: Path) -> None:
    generation = tmp_path / ".emt.feedc0de"
    generation.mkdir()
    make_generation_lock(generation)
    lock = generation / GENERATION_LOCK
    lock.chmod(0o444)  # what a user outside the group has: a read-only open
    with claim_generation(generation) as claimed:
        assert claimed is True
    holder = subprocess.Popen(
        [sys.executable, "-I", "-c", HOLDER, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        lock.chmod(0o664)  # the claimer is a maintainer: it can open for writing
        with claim_generation(generation) as claimed:
            assert claimed is False
        holder.stdin.close()  # the holder exits, and the kernel drops its lock
        assert holder.wait(timeout=30) == 0
        with claim_generation(generation) as claimed:
            assert claimed is True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, 9)
        holder.wait(timeout=30)
