"""Fixtures the system tests share."""

from __future__ import annotations

import os
import time

import pytest

from tests.system.slurm_chain import cluster_state


@pytest.fixture(scope="session")
def slurm() -> str:
    """The local SLURM's node state, once it is ready.

    Where SLURM is not installed the test is skipped, except under CI, whose
    ``.ci/run`` starts it (``scripts/dev/slurm-up``): there it fails.
    """
    state = cluster_state()
    if state is None:
        message = "SLURM is not installed here: run scripts/dev/slurm-up"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    deadline = time.monotonic() + 30
    while state not in ("idle", "mix", "alloc") and time.monotonic() < deadline:
        time.sleep(1)
        state = cluster_state()
    assert state in ("idle", "mix", "alloc"), f"local SLURM not ready (sinfo: {state})"
    return state
