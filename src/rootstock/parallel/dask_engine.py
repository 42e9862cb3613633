"""Dask: plain tasks (``pure=False``) on workers that each keep one warm Rootstock worker.

The warm calculators live in :class:`RootstockPlugin`, a ``WorkerPlugin`` the
scheduler installs on every worker, including one that replaces a dead worker.
Actors are not used: Dask does not reschedule an actor whose worker dies, while a
plain task on a dead worker runs again elsewhere (``allowed-failures``). Dask
never sets ``CUDA_VISIBLE_DEVICES``, so the plugin does, from the worker's index
within its job, before any Rootstock worker starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import CancelledError
from typing import Any

import distributed
from dask_jobqueue import SLURMCluster
from distributed import Client, WorkerPlugin

from rootstock.errors import EngineError, RootstockError, UsageError
from rootstock.parallel.warm import ChunkTask, WarmCache, run_chunk_task

PLUGIN_NAME = "rootstock"
#: How long a failed client call waits for the client's or cluster's status to say
#: "closing": a close from another thread cancels our futures a moment before.
CLOSE_GRACE_S = 2.0
_CLOSED = ("closing", "closed", "failed")

log = logging.getLogger("rootstock.parallel")


def worker_slot(name: Any, per_job: int) -> int:
    """This worker's index within its job, ``0 .. per_job-1``.

    dask-jobqueue names the workers of a ``--nworkers G`` job ``JOB-0 .. JOB-(G-1)``;
    a LocalCluster numbers its workers ``0, 1, ...``.
    """
    if per_job <= 1:
        return 0
    if isinstance(name, int):
        return name % per_job
    tail = str(name).rsplit("-", 1)[-1]
    return int(tail) % per_job if tail.isdigit() else 0


class RootstockPlugin(WorkerPlugin):
    """The warm calculators of one Dask worker, and its GPU.

    ``gpus_per_job``: the worker processes per job that share its node's GPUs, one
    each; the plugin sets ``CUDA_VISIBLE_DEVICES`` to the worker's slot. None
    leaves the variable as the job set it.
    """

    name = PLUGIN_NAME

    def __init__(self, gpus_per_job: int | None = None) -> None:
        self.gpus_per_job = gpus_per_job
        self.cache = WarmCache()

    def setup(self, worker: Any) -> None:
        self.cache = WarmCache()
        if self.gpus_per_job:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(worker_slot(worker.name, self.gpus_per_job))

    def teardown(self, worker: Any) -> None:
        self.cache.close()


def run_on_dask_worker(task: ChunkTask) -> Any:
    """The Dask task: the chunk on this worker's plugin cache."""
    plugin = distributed.get_worker().plugins.get(PLUGIN_NAME)
    return run_chunk_task(task, plugin.cache if isinstance(plugin, RootstockPlugin) else None)


def _plugin_names(dask_scheduler: Any) -> list[str]:
    return list(dask_scheduler.worker_plugins)


def ensure_plugin(client: Client, plugin: RootstockPlugin | None = None) -> None:
    """Install the plugin on the client's workers unless one is installed already
    (installing again would tear down, and so close, every warm worker)."""
    if plugin is None and PLUGIN_NAME in client.run_on_scheduler(_plugin_names):
        return
    client.register_plugin(plugin or RootstockPlugin(), name=PLUGIN_NAME)


def default_prologue() -> list[str]:
    """Activate this Python's venv in the batch job, so the workers run this rootstock."""
    return [f"source {sys.prefix}/bin/activate"]


def dask_slurm_client(
    *,
    account: str | None,
    partition: str,
    walltime: str,
    nodes: int,
    gpus_per_node: int | None = None,
    workers_per_node: int | None = None,
    cores_per_worker: int = 1,
    memory: str | None = None,
    job_script_prologue: list[str] | None = None,
    exclusive: bool = True,
    address: str | None = None,
    cluster_kwargs: dict[str, Any] | None = None,
) -> Client:
    """A Client on a dask-jobqueue SLURMCluster of ``nodes`` one-node jobs, submitted now.

    Each job runs one worker process per GPU (``gpus_per_node``, requested with
    ``--gpus-per-node`` and pinned by the plugin) or ``workers_per_node`` CPU
    workers (default 1), one thread each, with ``cores_per_worker`` CPUs each.
    ``memory`` is the job's memory (``--mem``; default: the partition's).
    ``address`` is the host the scheduler binds to (default: every interface).
    ``cluster_kwargs`` go to SLURMCluster as given. A refused ``sbatch`` raises
    EngineError with the scheduler's message.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes <= 0:
        raise UsageError(f"nodes must be a positive integer, not {nodes!r}")
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or gpus_per_node <= 0):
        raise UsageError(f"gpus_per_node must be a positive integer, not {gpus_per_node!r}")
    processes = gpus_per_node or workers_per_node or 1
    directives = ["--exclusive"] if exclusive else []
    if gpus_per_node:
        directives.append(f"--gpus-per-node={gpus_per_node}")
    options: dict[str, Any] = {
        "queue": partition,
        "account": account,
        "walltime": walltime,
        "processes": processes,
        "cores": processes,  # one thread per worker: chunks queue on the worker
        "job_cpu": processes * cores_per_worker,
        "memory": memory or f"{4 * processes}GB",  # what Dask lets the workers use
        "job_script_prologue": default_prologue()
        if job_script_prologue is None
        else job_script_prologue,
        "job_extra_directives": directives,
        "python": sys.executable,
    }
    if memory is None:
        options["job_directives_skip"] = ["--mem"]
    if address is not None:
        options["scheduler_options"] = {"host": address}
    options.update(cluster_kwargs or {})
    cluster = SLURMCluster(**options)
    client = Client(cluster)
    ensure_plugin(client, RootstockPlugin(gpus_per_node))
    try:
        _submit_jobs(cluster, nodes)
    except RuntimeError as exc:
        _drop_unsubmitted(cluster)
        client.close()
        cluster.close()
        raise EngineError(
            f"dask-jobqueue could not submit its SLURM job: {_sbatch_message(exc)}",
            hint="check partition=, account=, walltime= and the directives in cluster.job_script()",
        ) from None
    return client


def _submit_jobs(cluster: SLURMCluster, jobs: int) -> None:
    """Submit ``jobs`` more jobs now and wait for sbatch's answer.

    ``cluster.scale`` only schedules the submission on the cluster's event loop,
    where a refused sbatch is logged and forgotten; adding the jobs' specs and
    awaiting the cluster's own state correction here raises sbatch's failure.
    """
    for _ in range(jobs):
        cluster.worker_spec.update(cluster.new_worker_spec())
    cluster.sync(cluster._correct_state)


def _drop_unsubmitted(cluster: SLURMCluster) -> None:
    """Forget the jobs sbatch refused, so closing the cluster does not trip on them
    (SpecCluster asserts, on close, that every job it created was started)."""
    for job in list(cluster._created):
        if getattr(job, "job_id", None) is None:
            cluster._created.discard(job)
    for name, job in list(cluster.workers.items()):
        if getattr(job, "job_id", None) is None:
            del cluster.workers[name]
    for name in list(cluster.worker_spec):
        if name not in cluster.workers:
            del cluster.worker_spec[name]


def _sbatch_message(exc: RuntimeError) -> str:
    """sbatch's own words from dask-jobqueue's command failure (its stderr)."""
    text = str(exc)
    _, found, stderr = text.partition("stderr:")
    return stderr.strip() if found and stderr.strip() else text.strip()


def dask_local_client(
    workers: int = 2, gpus: int | None = None, address: str = "127.0.0.1"
) -> Client:
    """A Client on a LocalCluster of ``workers`` single-thread worker processes (one
    per GPU with ``gpus``, pinned by the plugin), listening on ``address`` only."""
    cluster = distributed.LocalCluster(
        n_workers=gpus or workers,
        threads_per_worker=1,
        processes=True,
        host=address,
        dashboard_address=f"{address}:0",  # its web server, on a free port of that host
    )
    client = Client(cluster)
    ensure_plugin(client, RootstockPlugin(gpus))
    return client


def _killed_summary(exc: BaseException) -> str:
    """What a KilledWorker says, read from its args: its ``__str__`` needs the
    scheduler's WorkerState, which may not survive the trip to the client."""
    args = exc.args
    tries = args[2] + 1 if len(args) > 2 and isinstance(args[2], int) else None
    last = getattr(args[1], "address", args[1]) if len(args) > 1 else None
    if tries == 1:
        text = "the worker that ran it"
    else:
        text = f"the {tries} workers that ran it" if tries else "every worker that ran it"
    text += " died while running it"
    return text + (f" (the last: {last})" if last else "")


class DaskEngine:
    """The dispatch loop's view of a distributed.Client.

    A client or cluster closed while the loop runs (by the user's code, from
    another thread) surfaces as an :class:`EngineError` saying so, whatever Dask
    raised (``ClosedClientError``, ``CancelledError``, an empty scheduler info),
    and :meth:`cancel` never raises over it.
    """

    name = "Dask"

    def __init__(self, client: Client) -> None:
        self.client = client

    @classmethod
    def open(cls, client: Client) -> DaskEngine:
        if client.status not in ("running", "newly-created"):
            raise UsageError(
                f"this Dask client is {client.status}",
                hint="pass a connected distributed.Client",
            )
        ensure_plugin(client)
        return cls(client)

    def closed(self) -> str | None:
        """``"cluster"`` or ``"client"`` once either is closing or closed, else None."""
        cluster = getattr(self.client, "cluster", None)
        status = getattr(getattr(cluster, "status", None), "name", None)
        if status in _CLOSED:
            return "cluster"
        if str(self.client.status) in _CLOSED:
            return "client"
        return None

    def _closed_error(self, what: str) -> EngineError:
        return EngineError(
            f"the Dask {what} was closed during the run; the structures not yet "
            "returned were not computed",
            hint="close the Dask client and its cluster only after rootstock.evaluate "
            "returns (or after the evaluate_iter iterator is exhausted or closed)",
        )

    def _check_open(self) -> None:
        what = self.closed()
        if what is not None:
            raise self._closed_error(what)

    @contextlib.contextmanager
    def _dask_call(self, doing: str) -> Iterator[None]:
        """Dask's failures inside the block as EngineError (see :meth:`_failure`)."""
        try:
            yield
        except RootstockError:
            raise
        except Exception as exc:
            raise self._failure(exc, doing) from None

    def _failure(self, exc: Exception, doing: str) -> EngineError:
        """The EngineError for Dask's ``exc``: the close, if the client or cluster is
        closing (waiting a moment for its status to say so), else Dask's own words."""
        deadline = time.monotonic() + CLOSE_GRACE_S
        while (what := self.closed()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if what is not None:
            return self._closed_error(what)
        return EngineError(
            f"the Dask client failed while {doing}: {type(exc).__name__}: {exc}",
            hint="check that the Dask scheduler is still running (client.status, "
            "the scheduler's log); a client.cancel() or client.restart() elsewhere "
            "cancels rootstock's chunks too",
        )

    def workers(self) -> int:
        self._check_open()
        with self._dask_call("asking for its workers"):
            return len(self.client.scheduler_info(n_workers=-1)["workers"])

    def capacity(self) -> int:
        """The workers the client's cluster plans (a queued job's too), else those
        connected: a user's Client may have no cluster object."""
        plan = getattr(getattr(self.client, "cluster", None), "plan", None)
        planned = len(plan) if isinstance(plan, set) else 0
        return max(planned, self.workers())

    def submit(self, task: ChunkTask) -> Any:
        self._check_open()
        with self._dask_call("submitting a chunk"):
            return self.client.submit(
                run_on_dask_worker,
                task,
                pure=False,
                key=f"rootstock-chunk-{task.first}-{uuid.uuid4().hex}",
            )

    def wait(self, futures: list[Any], timeout: float) -> list[Any]:
        self._check_open()
        with self._dask_call("waiting for chunks"):
            try:
                done, _ = distributed.wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")
            except TimeoutError:
                return []
        return list(done)

    def result(self, future: Any) -> Any:
        try:
            return future.result()
        except RootstockError:
            raise
        except distributed.KilledWorker as exc:
            raise EngineError(
                f"Dask gave up on chunk {future.key}: {_killed_summary(exc)}",
                hint="raise distributed.scheduler.allowed-failures, or look for what "
                "kills the workers (memory limits, the job's walltime)",
            ) from None
        except Exception as exc:
            if isinstance(exc, CancelledError) or self.closed() is not None:
                # Cancelled by the scheduler, not failed on a worker: most likely the
                # client or its cluster is going away.
                raise self._failure(exc, f"fetching chunk {future.key}") from None
            raise EngineError(
                f"a Dask task failed: {type(exc).__name__}: {exc}",
                hint="look in the workers' logs",
            ) from None

    def cancel(self, futures: list[Any]) -> None:
        """Cancel the chunks in flight; never raises (it runs while an error unwinds).

        A closed client has nothing left to cancel: the scheduler drops the tasks
        of a client that went away.
        """
        if self.closed() is not None:
            return
        try:
            self.client.cancel(futures)
        except Exception as exc:
            log.warning("could not cancel %d Dask chunk(s): %s", len(futures), exc)

    def _slurm_jobs(self) -> list[str]:
        cluster = getattr(self.client, "cluster", None)
        if not isinstance(cluster, SLURMCluster):
            return []
        jobs = [getattr(job, "job_id", None) for job in cluster.workers.values()]
        return [j for j in jobs if j]

    def _squeue(self, jobs: list[str]) -> list[str] | None:
        if not shutil.which("squeue"):
            return None
        proc = subprocess.run(
            ["squeue", "-h", "-j", ",".join(jobs), "-o", "%i %T %r"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        return proc.stdout.strip().splitlines() if proc.returncode == 0 else None

    def startup_problem(self) -> str | None:
        """Every SLURM job of the cluster has left the queue, and no worker came."""
        jobs = self._slurm_jobs()
        if not jobs:
            return None
        lines = self._squeue(jobs)
        if lines is None or lines:
            return None
        return (
            f"SLURM job(s) {', '.join(jobs)} ended before a worker connected; their "
            "output (slurm-JOBID.out in the submit directory) says why"
        )

    def queue_state(self) -> str | None:
        """The queue's state and reason for the cluster's SLURM jobs, from squeue."""
        jobs = self._slurm_jobs()
        lines = self._squeue(jobs) if jobs else None
        return "; ".join(f"job {line}" for line in lines) if lines else None
