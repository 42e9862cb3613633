"""What runs inside an engine worker: one warm calculator per worker key, and the task.

An engine worker (a Parsl HTEX worker process, a Dask worker) lives across many
tasks. The first chunk it runs for a checkpoint starts a Rootstock worker, which
stays warm in a cache for every later chunk: one model load per engine worker,
not per task. Parsl uses this module's cache; Dask hands in the one its
``RootstockPlugin`` keeps on the worker. Nothing here imports an engine.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rootstock.runtime import worker_key

if TYPE_CHECKING:
    from rootstock.runtime import Outcome, RootstockCalculator
    from rootstock.wire.batch import MemoryLimit


@dataclass(frozen=True)
class ChunkTask:
    """One chunk of the input, as it travels to an engine worker (pickled).

    ``calculator`` was resolved by the client and never started: it pickles as its
    spec and options, without a worker. ``items`` keeps the input's own indices;
    ``memory`` is the bound the chunk's BATCH carries (``batch_size="auto"``).
    """

    calculator: RootstockCalculator
    items: tuple[tuple[int, Any], ...]
    properties: tuple[str, ...]
    memory: MemoryLimit | None = None

    @property
    def first(self) -> int:
        return self.items[0][0]

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(index for index, _ in self.items)


class WarmCache:
    """Warm calculators of one engine worker, by worker key; closed together."""

    def __init__(self) -> None:
        self._calculators: dict[Hashable, RootstockCalculator] = {}
        self._lock = threading.Lock()

    def calculator(self, template: RootstockCalculator) -> RootstockCalculator:
        """The warm calculator for ``template``'s worker, the template itself the
        first time. Per-call options (timeout, chunk sizes) follow the template."""
        key = (worker_key(template.spec), template.pool, template.allow_nonfinite)
        with self._lock:
            calc = self._calculators.setdefault(key, template)
        if calc is not template:
            calc.timeout = template.timeout
            calc.batch_size = template.batch_size
            calc.max_atoms_per_chunk = template.max_atoms_per_chunk
            calc.max_memory = template.max_memory
        return calc

    def __len__(self) -> int:
        return len(self._calculators)

    def __reduce__(self) -> tuple[type[WarmCache], tuple[()]]:
        # A cache travels (inside a Dask plugin) as an empty one: warm workers are
        # local to their engine worker.
        return (WarmCache, ())

    def close(self) -> None:
        with self._lock:
            calculators = list(self._calculators.values())
            self._calculators.clear()
        for calc in calculators:
            calc.close()


#: The cache of this process: a Parsl worker's (a module global lives across tasks).
PROCESS_CACHE = WarmCache()


def run_chunk_task(task: ChunkTask, cache: WarmCache | None = None) -> list[tuple[int, Outcome]]:
    """Evaluate one chunk on this engine worker's warm calculator.

    Per-structure model failures come back in their slots as WorkerError (the
    client applies ``errors=``); a dead or stuck Rootstock worker raises, so the
    engine retries the chunk, and the cache's next chunk starts a fresh worker.
    """
    from rootstock.runtime import run_chunk

    calc = (PROCESS_CACHE if cache is None else cache).calculator(task.calculator)
    return run_chunk(calc, list(task.items), task.properties, task.memory)
