"""Helpers for the pool's tests: pooled calculators on a test root, and waiting.

Their structures and reference energies are :mod:`tests.integration.structures`."""

from __future__ import annotations

import time
from pathlib import Path

from rootstock import RootstockCalculator


def pooled(root: Path, checkpoint: str = "emt", **kwargs) -> RootstockCalculator:
    return RootstockCalculator(checkpoint, root=root, device="cpu", pool=True, **kwargs)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)
