"""Roots whose builds have images, and private stage directories, for the image and stage
tests (real uv, real ``mksquashfs``, real ``squashfuse`` and FUSE).

Every other test root is built without images (``$ROOTSTOCK_IMAGES=0``, tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from ase import Atoms

from rootstock.runtime.stage import STAGE_ENV, STAGE_IDLE_ENV
from rootstock.runtime.stage_dir import STAGE_DIR_ENV
from tests.conftest import copy_root, make_root, run_rootstock
from tests.integration.pooling import wait_for
from tests.integration.structures import cu
from tests.leftovers import mounts_below
from tests.run_cache import shared_build

REPO = Path(__file__).resolve().parents[2]
SAMPLE_EMT = REPO / "environments" / "emt.py"
#: Long enough for any wait in these tests; a slow machine only waits longer.
DEADLINE_S = 120.0


def cu_cell(seed: int) -> Atoms:
    """An 8-atom Cu cell at ASE's reference lattice constant, rattled by ``seed``."""
    return cu(seed=seed, a=3.61)


@pytest.fixture(scope="session")
def image_root(shared_uv_cache: Path, torch_pin: dict[str, str]) -> Path:
    """A root with the sample EMT env built by ``install --image``; shared, never modified."""

    def build(root: Path) -> None:
        make_root(root, shared_uv_cache)
        run_rootstock("install", SAMPLE_EMT, "--root", root, "--image", "--no-push")

    return shared_build("emt-image-root", build)


@pytest.fixture
def own_image_root(image_root: Path, tmp_path: Path) -> Path:
    """A private copy of :func:`image_root`, for a test that changes it."""
    return copy_root(image_root, tmp_path / "root")


def keeper_pids(base: Path) -> list[int]:
    """The keepers (and their squashfuse) that the stage entries below ``base`` recorded."""
    pids = []
    for record in base.glob("*/*/keeper.json"):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(record.read_text())
            pids += [p for p in (data.get("pid"), data.get("squashfuse")) if isinstance(p, int)]
    return pids


@pytest.fixture
def stage_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private ``$ROOTSTOCK_STAGE_DIR`` for this test, mounts idle out after 1 s.

    Teardown stops every keeper, unmounts every mount below it and deletes it.
    """
    base = tmp_path / "stg"
    base.mkdir()
    monkeypatch.setenv(STAGE_DIR_ENV, str(base))
    monkeypatch.setenv(STAGE_IDLE_ENV, "1")
    monkeypatch.delenv(STAGE_ENV, raising=False)
    try:
        yield base
    finally:
        for pid in keeper_pids(base):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not mounts_below([base]), 30, "the stage mounts to go")
        for point in reversed(mounts_below([base])):
            subprocess.run(["fusermount3", "-u", "-z", point], timeout=60, check=False)
        for pid in keeper_pids(base):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def stage_entries(base: Path) -> list[Path]:
    root = base / f".rootstock-stage-{os.getuid()}"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir())


def worker_argv0(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
