"""Chunks of a batch request as engine tasks: bounded in flight, results as completed.

``rootstock.evaluate(..., executor=...)`` lands here. The engine-neutral loop
(:func:`scale_out`) reads the input one chunk at a time, keeps at most
``max_in_flight`` chunks submitted (two per engine worker by default), yields each
finished chunk's ``(index, result)`` pairs, and drops the results of a chunk that
ran twice. The engines (``parsl_engine``, ``dask_engine``) only submit, wait,
fetch and explain why nothing runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from rootstock.errors import EngineError, UsageError, WorkerError
from rootstock.parallel.warm import ChunkTask

if TYPE_CHECKING:
    from rootstock.runtime import BatchPlan, Outcome, RootstockCalculator

SUPPORTED = (
    "a Parsl Config (parsl.config.Config, e.g. rootstock.parallel.parsl_slurm_config(...)), "
    "a loaded Parsl DataFlowKernel, or a Dask distributed.Client "
    "(e.g. rootstock.parallel.dask_slurm_client(...))"
)
log = logging.getLogger("rootstock.parallel")
#: How often the loop wakes while nothing finishes, to ask the engine about its workers.
POLL_SECONDS = 1.0


class Engine(Protocol):
    """What :func:`scale_out` needs of an engine; futures are the engine's own."""

    name: str

    def workers(self) -> int:
        """Engine workers connected now (0 while the jobs are still queued)."""
        ...

    def capacity(self) -> int:
        """Engine workers expected once every job runs (bounds the chunks in flight)."""
        ...

    def submit(self, task: ChunkTask) -> Any: ...

    def wait(self, futures: list[Any], timeout: float) -> list[Any]:
        """The futures among ``futures`` that are done, after at most ``timeout`` s."""
        ...

    def result(self, future: Any) -> list[tuple[int, Outcome]]:
        """A finished chunk's outcomes; engine failures as RootstockError."""
        ...

    def cancel(self, futures: list[Any]) -> None: ...

    def startup_problem(self) -> str | None:
        """Why no worker can run, in the scheduler's words: set only once the jobs
        were refused or ended (a job still queued is not a problem)."""
        ...

    def queue_state(self) -> str | None:
        """What the scheduler says of the jobs now (for a timeout's message)."""
        ...


def engine_kind(executor: Any) -> str | None:
    """``"parsl"`` or ``"dask"`` for an executor object of those engines, else None.

    Decided from the object's type alone, so neither engine is imported to refuse
    an executor of another kind.
    """
    module = type(executor).__module__.split(".", 1)[0]
    name = type(executor).__name__
    if module == "parsl" and name in ("Config", "DataFlowKernel"):
        return "parsl"
    if module == "distributed" and name == "Client":
        return "dask"
    return None


def check_executor(executor: Any) -> None:
    """UsageError for an executor of a type no engine takes, before anything starts."""
    if engine_kind(executor) is None:
        raise UsageError(
            f"rootstock.evaluate cannot use executor={type(executor).__module__}."
            f"{type(executor).__name__}",
            hint=f"pass executor=None (this process), or {SUPPORTED}",
        )


def open_engine(executor: Any) -> Engine:
    """The engine adapter for ``executor`` (which :func:`check_executor` accepted)."""
    if engine_kind(executor) == "parsl":
        from rootstock.parallel.parsl_engine import ParslEngine

        return ParslEngine.open(executor)
    from rootstock.parallel.dask_engine import DaskEngine

    return DaskEngine.open(executor)


class Collector:
    """Accepts each chunk's outcomes once: a chunk that ran twice (a retry after its
    first run was thought lost) is dropped, so every input index appears once.

    Chunks are remembered by their first index: a few integers per chunk, not one
    per structure.
    """

    def __init__(self) -> None:
        self._done: set[int] = set()

    def accept(
        self, task: ChunkTask, outcomes: list[tuple[int, Outcome]]
    ) -> list[tuple[int, Outcome]]:
        if task.first in self._done:
            return []
        if [index for index, _ in outcomes] != list(task.indices):
            raise EngineError(
                f"an engine worker returned results for other structures than chunk "
                f"{task.first}..{task.indices[-1]} it was given",
                hint="the engine workers run another rootstock version: use one venv",
            )
        self._done.add(task.first)
        return outcomes

    def __len__(self) -> int:
        return len(self._done)


def scale_out(
    executor: Any,
    calc: RootstockCalculator,
    plan: BatchPlan,
    max_in_flight: int | None,
    start_timeout: float | None,
) -> Iterator[tuple[int, Outcome]]:
    """``(index, result)`` for every structure of ``plan``, as chunks complete.

    Nothing starts for an empty input. Raising on a failed structure
    (``errors="raise"``) or closing the iterator cancels the chunks in flight.
    """
    if max_in_flight is not None and (
        isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight <= 0
    ):
        raise UsageError(f"max_in_flight must be a positive integer, not {max_in_flight!r}")
    if start_timeout is not None and not start_timeout > 0:
        raise UsageError("start_timeout must be a positive number of seconds, or None")
    chunks = plan.chunks()
    first = next(chunks, None)
    if first is None:
        return iter(())
    return _run(executor, calc, plan, first, chunks, max_in_flight, start_timeout)


def _run(
    executor: Any,
    calc: RootstockCalculator,
    plan: BatchPlan,
    first: list[tuple[int, Any]],
    chunks: Iterator[list[tuple[int, Any]]],
    max_in_flight: int | None,
    start_timeout: float | None,
) -> Iterator[tuple[int, Outcome]]:
    engine = open_engine(executor)
    collector = Collector()
    pending: dict[Any, ChunkTask] = {}
    queued: list[tuple[int, Any]] | None = first
    started = time.monotonic()
    try:
        while True:
            limit = max_in_flight or 2 * max(1, engine.workers(), engine.capacity())
            while queued is not None and len(pending) < limit:
                items = tuple((i, a.copy()) for i, a in queued)
                task = ChunkTask(calc, items, plan.properties, plan.memory)
                pending[engine.submit(task)] = task
                queued = next(chunks, None)
            if not pending:
                return
            done = engine.wait(list(pending), POLL_SECONDS)
            if not done:
                if not collector and engine.workers() == 0:
                    _check_start(engine, started, start_timeout)
                continue
            for future in done:
                task = pending.pop(future)
                for index, outcome in collector.accept(task, engine.result(future)):
                    if plan.raise_errors and isinstance(outcome, WorkerError):
                        raise outcome
                    yield index, outcome
    finally:
        if pending:
            _cancel_quietly(engine, list(pending))


def _cancel_quietly(engine: Engine, futures: list[Any]) -> None:
    """Cancel what is in flight without ever raising: this runs while the real error
    (or the iterator's close) unwinds, and a failed cancel must not replace it."""
    try:
        engine.cancel(futures)
    except Exception as exc:
        log.warning("could not cancel %d %s chunk(s): %s", len(futures), engine.name, exc)


def _check_start(engine: Engine, started: float, start_timeout: float | None) -> None:
    """EngineError once no worker has come within ``start_timeout`` seconds, or as
    soon as the engine reports that its jobs cannot start."""
    problem = engine.startup_problem()
    waited = time.monotonic() - started
    if problem is None and (start_timeout is None or waited < start_timeout):
        return
    if problem is not None:
        message = f"{engine.name} could not start its workers: {problem}"
    else:
        message = f"no {engine.name} worker arrived within {start_timeout:g} s"
        state = engine.queue_state()
        if state:
            message += f" (the scheduler: {state})"
    raise EngineError(
        message,
        hint="check the scheduler's queue and the job's output; a long queue wait needs "
        "a larger start_timeout= (seconds, or None to wait for ever)",
    )
