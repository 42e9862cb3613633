"""Parsl: a HighThroughputExecutor whose workers each keep one warm Rootstock worker.

A Parsl ``Config`` is loaded once per process (Parsl allows one) and kept until
:func:`shutdown` or exit; an already loaded ``DataFlowKernel`` is used as given.
Tasks are :func:`rootstock.parallel.warm.run_chunk_task`, whose module cache
keeps the calculator warm in each HTEX worker process. GPU pinning is Parsl's own:
``available_accelerators`` sets ``CUDA_VISIBLE_DEVICES`` per worker, and the
Rootstock worker inherits it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import shlex
import sys
import threading
import time
from typing import Any

import parsl
from parsl.app.python import PythonApp
from parsl.config import Config
from parsl.dataflow.dflow import DataFlowKernel
from parsl.errors import NoDataFlowKernelError
from parsl.executors import HighThroughputExecutor
from parsl.executors.errors import BadStateException
from parsl.launchers import SingleNodeLauncher
from parsl.providers import LocalProvider, SlurmProvider

from rootstock.errors import EngineError, RootstockError, UsageError
from rootstock.parallel.warm import ChunkTask, run_chunk_task

LABEL = "rootstock"
_lock = threading.Lock()
_loaded: tuple[Config, DataFlowKernel] | None = None
_exit_hook: list[bool] = []  # non-empty once shutdown() is registered to run at exit


def default_worker_init() -> str:
    """Activate this Python's venv in the batch job, so the workers run this rootstock."""
    return f"source {shlex.quote(sys.prefix)}/bin/activate"


def _executor(
    label: str,
    provider: Any,
    workers_per_node: int | None,
    gpus_per_node: int | None,
    address: str | None,
    heartbeat_period: int,
    heartbeat_threshold: int | None,
) -> HighThroughputExecutor:
    if gpus_per_node is not None and (gpus_per_node <= 0 or isinstance(gpus_per_node, bool)):
        raise UsageError(f"gpus_per_node must be a positive integer, not {gpus_per_node!r}")
    return HighThroughputExecutor(
        label=label,
        provider=provider,
        address=address,
        # This Python's interchange, whether or not its venv's bin/ is on PATH.
        interchange_launch_cmd=[
            sys.executable,
            "-m",
            "parsl.executors.high_throughput.interchange",
        ],
        # One worker per GPU, each pinned to it; without GPUs, workers_per_node (1).
        available_accelerators=gpus_per_node or (),
        max_workers_per_node=None if gpus_per_node else (workers_per_node or 1),
        cores_per_worker=1.0,
        heartbeat_period=heartbeat_period,
        heartbeat_threshold=heartbeat_threshold or 4 * heartbeat_period,
    )


def parsl_slurm_config(
    *,
    account: str | None,
    partition: str,
    walltime: str,
    nodes: int,
    gpus_per_node: int | None = None,
    workers_per_node: int | None = None,
    worker_init: str | None = None,
    exclusive: bool = True,
    address: str | None = None,
    retries: int = 2,
    heartbeat_period: int = 30,
    heartbeat_threshold: int | None = None,
    scheduler_options: str = "",
    run_dir: str = "runinfo",
) -> Config:
    """A Parsl Config: one HighThroughputExecutor on ``nodes`` SLURM jobs of one node.

    ``gpus_per_node`` requests that many GPUs per job (``--gpus-per-node``) and
    runs one worker per GPU, pinned through ``available_accelerators``; without it,
    ``workers_per_node`` CPU workers (default 1). A job that does not hold its node
    (``exclusive=False``) asks for one CPU per worker. ``worker_init`` runs in the job
    before the workers start (default: activate this Python's venv). ``address``
    is the address the workers reach this process on (the interchange binds
    there; default: Parsl probes every interface). A chunk whose worker is lost
    runs again up to ``retries`` times; a worker silent for ``heartbeat_threshold``
    seconds (default 4 × ``heartbeat_period``) counts as lost.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes <= 0:
        raise UsageError(f"nodes must be a positive integer, not {nodes!r}")
    provider = SlurmProvider(
        partition=partition,
        account=account,
        walltime=walltime,
        nodes_per_block=1,
        init_blocks=nodes,
        min_blocks=nodes,
        max_blocks=nodes,
        gpus_per_node=gpus_per_node,
        exclusive=exclusive,
        # A shared node gives the job one CPU unless asked: one per worker, so that
        # SLURM's cgroup (and Parsl's PARSL_CORES) leave room for every worker.
        cores_per_node=None if exclusive else (gpus_per_node or workers_per_node or 1),
        scheduler_options=scheduler_options,
        worker_init=default_worker_init() if worker_init is None else worker_init,
        launcher=SingleNodeLauncher(),
    )
    executor = _executor(
        LABEL, provider, workers_per_node, gpus_per_node, address, heartbeat_period,
        heartbeat_threshold,
    )  # fmt: skip
    return Config(executors=[executor], retries=retries, run_dir=run_dir)


def parsl_local_config(
    workers: int = 2,
    gpus: int | None = None,
    address: str = "127.0.0.1",
    retries: int = 2,
    heartbeat_period: int = 30,
    heartbeat_threshold: int | None = None,
    run_dir: str = "runinfo",
) -> Config:
    """A Parsl Config for one machine (a laptop, an interactive node): ``workers``
    HTEX workers on a LocalProvider, or one per GPU pinned to it with ``gpus``."""
    provider = LocalProvider(
        init_blocks=1, min_blocks=1, max_blocks=1, worker_init=default_worker_init()
    )
    executor = _executor(
        LABEL, provider, workers, gpus, address, heartbeat_period, heartbeat_threshold
    )
    return Config(executors=[executor], retries=retries, run_dir=run_dir)


def load(executor: Config | DataFlowKernel) -> DataFlowKernel:
    """The DataFlowKernel for ``executor``: a Config is loaded the first time only."""
    global _loaded
    if isinstance(executor, DataFlowKernel):
        if executor.cleanup_called:
            raise UsageError(
                "this Parsl DataFlowKernel was cleaned up",
                hint="load a new config (parsl.load) and pass it, or pass a Config",
            )
        return executor
    with _lock:
        if _loaded is not None and not _loaded[1].cleanup_called:
            if _loaded[0] is executor:
                return _loaded[1]
            raise UsageError(
                "Parsl allows one loaded config per process, and rootstock already "
                "loaded a different one",
                hint="pass the same Config object again, or call "
                "rootstock.parallel.shutdown() before using another",
            )
        try:
            current = parsl.dfk()
        except NoDataFlowKernelError:
            pass
        else:
            if current.cleanup_called:
                # Cleaned up by its owner but never cleared: nothing runs on it.
                parsl.clear()
            else:
                raise UsageError(
                    "a Parsl config is already loaded in this process (parsl.load), and "
                    "Parsl allows only one",
                    hint="pass executor=parsl.dfk() to run on it, or clean it up first "
                    "(parsl.dfk().cleanup(); parsl.clear())",
                )
        dfk = parsl.load(executor)
        _loaded = (executor, dfk)
        if not _exit_hook:
            # Parsl's own exit hook only warns: without this, the interchange and the
            # worker pools (and their warm workers) would outlive this process.
            atexit.register(shutdown)
            _exit_hook.append(True)
        return dfk


def shutdown() -> None:
    """Stop the Parsl config rootstock loaded (its jobs, and with them the warm
    workers). Safe to call when none is loaded; exit does the same."""
    global _loaded
    with _lock:
        loaded, _loaded = _loaded, None
    if loaded is not None and not loaded[1].cleanup_called:
        try:
            loaded[1].cleanup()
        finally:
            parsl.clear()


class ParslEngine:
    """The dispatch loop's view of a DataFlowKernel."""

    name = "Parsl"

    def __init__(self, dfk: DataFlowKernel) -> None:
        self.dfk = dfk
        self.app = PythonApp(run_chunk_task, data_flow_kernel=dfk, executors="all")
        self._workers = (0.0, 0)

    @classmethod
    def open(cls, executor: Config | DataFlowKernel) -> ParslEngine:
        return cls(load(executor))

    def _executors(self) -> list[Any]:
        return [e for e in self.dfk.executors.values() if e.label != "_parsl_internal"]

    def workers(self) -> int:
        # One interchange round trip, at most once a second.
        checked, count = self._workers
        if time.monotonic() - checked < 1.0:
            return count
        count = 0
        for executor in self._executors():
            if isinstance(executor, HighThroughputExecutor):
                count += sum(m["worker_count"] for m in executor.connected_managers())
            else:
                count += 1
        self._workers = (time.monotonic(), count)
        return count

    def capacity(self) -> int:
        total = 0
        for executor in self._executors():
            if isinstance(executor, HighThroughputExecutor):
                per_node = executor.workers_per_node
                per_node = 1 if per_node == float("inf") else int(per_node)
                provider = executor.provider
                if provider is not None:
                    per_node *= provider.nodes_per_block * provider.max_blocks
                total += per_node
            else:
                total += int(getattr(executor, "max_threads", 1))
        return max(total, 1)

    def submit(self, task: ChunkTask) -> Any:
        return self.app(task)

    def wait(self, futures: list[Any], timeout: float) -> list[Any]:
        done, _ = concurrent.futures.wait(
            futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
        )
        return list(done)

    def result(self, future: Any) -> Any:
        try:
            return future.result()
        except RootstockError:
            raise
        except BadStateException as exc:
            raise EngineError(
                f"Parsl could not start its workers: {exc}",
                hint="check the provider's settings (account, partition, walltime) "
                "and the job's output in the run directory",
            ) from None
        except Exception as exc:
            raise EngineError(
                f"a Parsl task failed after {self.dfk.config.retries} retries: "
                f"{type(exc).__name__}: {exc}",
                hint="raise the config's retries, or look in the run directory's logs",
            ) from None

    def cancel(self, futures: list[Any]) -> None:
        # Parsl cannot cancel a submitted task: those in flight finish on their
        # workers and their results are dropped.
        return None

    def startup_problem(self) -> str | None:
        # Parsl marks an executor bad once all its blocks failed (a refused sbatch
        # fails its block at once). Otherwise only blocks that all ended count: a
        # job still queued or running is no problem, and Parsl may start another.
        problems = []
        for executor in self._executors():
            if executor.bad_state_is_set:
                problems.append(" ".join(str(executor.executor_exception).split()))
                continue
            blocks = dict(getattr(executor, "status_facade", {}))
            if blocks and all(status.terminal for status in blocks.values()):
                problems.extend(
                    _describe(executor, block, status, output=True)
                    for block, status in blocks.items()
                )
        return "; ".join(problems) or None

    def queue_state(self) -> str | None:
        states = [
            _describe(executor, block, status, output=False)
            for executor in self._executors()
            for block, status in dict(getattr(executor, "status_facade", {})).items()
        ]
        return "; ".join(states) or None


def _describe(executor: Any, block: str, status: Any, output: bool) -> str:
    """``block 0 (job 123): PENDING (BeginTime)``: a block's state in the scheduler's
    words; with ``output``, also the tail of the job's stderr (why it ended)."""
    job = getattr(executor, "blocks_to_job_id", {}).get(block)
    text = f"block {block}" + (f" (job {job})" if job else "") + f": {status.state.name}"
    reason = _slurm_reason(executor.provider, job) if job else None
    if reason:
        text += f" ({reason})"
    if status.message:
        text += f": {' '.join(str(status.message).split())}"
    if output and status.stderr_summary:
        text += f"; the job's stderr ends: {status.stderr_summary.strip()[-500:]}"
    return text


def _slurm_reason(provider: Any, job: str) -> str | None:
    """SLURM's reason for a queued job (``BeginTime``, ``Resources``...), which
    Parsl's own status drops; None for other providers or a job squeue forgot."""
    if not isinstance(provider, SlurmProvider):
        return None
    try:
        code, out, _ = provider.execute_wait(f"squeue -h -j {shlex.quote(str(job))} -o %r", 10)
    except Exception:  # the reason only decorates an error message: never fail for it
        return None
    reason = out.strip()
    return reason if code == 0 and reason and reason != "None" else None
