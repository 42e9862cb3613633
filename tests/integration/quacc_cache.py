"""quacc's calculator cache, emptied around a test, with no worker left behind.

quacc builds ``RootstockCalculator(**kwargs)`` itself and keeps it in the cache of
``pick_calculator``, which exposes no values. A calculator left there lives until the
test process exits, and its worker and run dir with it; the run's leftovers check
then finds the run dir of a pytest-xdist worker that was stopped before its exit
finalizers ran. So every test that runs a quacc recipe empties the cache afterwards
and waits for the cached calculators' workers to stop.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Iterator

from rootstock.runtime.calculator import RootstockCalculator
from tests.integration.killing import is_running

#: How long the workers of the emptied cache may take to stop.
STOP_DEADLINE_S = 60.0


def live_calculators() -> list[RootstockCalculator]:
    """Every calculator on the heap (quacc's cache exposes no values)."""
    return [obj for obj in gc.get_objects() if isinstance(obj, RootstockCalculator)]


def worker_pids(calculators: list[RootstockCalculator]) -> list[int]:
    """The pids of the calculators' workers, for those that have one.

    The heap may also hold a calculator whose constructor raised (another test's
    ``pytest.raises`` keeps its traceback alive): it never had a worker, and a
    property of it may raise AttributeError, so it counts as none.
    """
    pids = [getattr(calc, "worker_pid", None) for calc in calculators]
    return [pid for pid in pids if pid is not None]


@contextlib.contextmanager
def emptied_quacc_cache() -> Iterator[None]:
    """Empty quacc's cache before and after; fail if a worker started during the test
    outlives the cache."""
    from quacc.recipes.mlip._base import pick_calculator

    pick_calculator.__wrapped__.cache_clear()
    # Calculators made already (a module's own reference calculator, whose worker may
    # start only during the test) are not quacc's.
    before = weakref.WeakSet(live_calculators())
    yield
    pids = worker_pids([calc for calc in live_calculators() if calc not in before])
    pick_calculator.__wrapped__.cache_clear()
    # quacc's results hold the atoms, whose .calc is the calculator: a cycle.
    gc.collect()
    deadline = time.monotonic() + STOP_DEADLINE_S
    while any(is_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if is_running(p)], "a worker outlived quacc's cache"
