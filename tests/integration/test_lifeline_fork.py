"""A forked copy of the lifeline's starter does not keep the child's lifeline open.

Moved from tests/unit (which starts no process, forked ones included); the other
lifeline tests, in one process, are in tests/unit/test_lifeline.py.
"""

from __future__ import annotations

import os
import time

import pytest

from rootstock.wire.lifeline import Lifeline
from tests.unit.test_lifeline import watched

pytestmark = pytest.mark.timeout(30)


def test_a_forked_copy_of_the_starter_does_not_hold_the_lifeline():
    # multiprocessing's fork start method, or a user's os.fork(): the copy must not
    # keep the starter's workers alive once the starter itself is gone.
    lifeline = Lifeline()
    lost, read_end = watched(lifeline)
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        time.sleep(10)
        os._exit(0)
    try:
        lifeline.close()
        assert lost.wait(5), "the forked child kept the write end open"
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        os.close(read_end)
