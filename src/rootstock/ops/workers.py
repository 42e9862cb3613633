"""``rootstock workers``: start, list and stop the user's pooled workers on this node.

Each pooled worker is a daemon (:mod:`rootstock.runtime.pool.daemon`) named by its worker
key's digest, which is the id these operations take and return. Everything here
reads the state files in the user's private pool directory and checks each
daemon's liveness (pid and start time), so a daemon killed without cleaning up is
listed as gone and its files are removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rootstock.errors import UsageError, WorkerTimeout
from rootstock.runtime import (
    DEFAULT_IDLE_TIMEOUT,
    PoolFileError,
    PoolFiles,
    WorkerOptions,
    clean_if_dead,
    daemon_alive,
    ensure_daemon,
    ensure_pool_dir,
    read_pool_json,
    read_states,
    resolve_worker_spec,
    worker_key,
)

log = logging.getLogger("rootstock.runtime")

#: The ``--json`` shape's version (docs/cli.md, "rootstock workers").
WORKERS_SCHEMA = 1
# A stopped daemon finishes its call in flight (up to its grace) and stops its worker.
STOP_WAIT_S = 15.0


@dataclass(frozen=True)
class PooledWorker:
    """One pooled worker, as ``rootstock workers list --json`` shows it."""

    id: str
    checkpoint: str
    env: str
    device: str
    root: str
    daemon_pid: int | None
    worker_pid: int | None
    clients: int
    started: str
    idle_timeout: float
    stale: bool
    socket: str
    log: str
    #: ``enabled`` (ROOTSTOCK_POOL_MERGE), ``worker`` (whether it takes merged calls;
    #: None until its first reply says) and ``max_wait_ms``.
    merging: dict[str, Any] = field(default_factory=dict)
    #: The daemon's traffic (:class:`rootstock.runtime.pool.merging.PoolStats`):
    #: requests, batches, merged_batches, batch_size_mean/max, queue_wait_ms p50/p99.
    #: Written every 2 s while it changes; empty from a daemon older than the counters.
    stats: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The documented JSON object."""
        return asdict(self)


def _record(state: dict[str, Any]) -> PooledWorker:
    daemon = state.get("daemon") if isinstance(state.get("daemon"), dict) else {}
    return PooledWorker(
        id=str(state.get("id", "")),
        checkpoint=str(state.get("checkpoint", "")),
        env=str(state.get("env", "")),
        device=str(state.get("device", "")),
        root=str(state.get("root", "")),
        daemon_pid=daemon.get("pid") if isinstance(daemon, dict) else None,
        worker_pid=state.get("worker_pid"),
        clients=int(state.get("clients") or 0),
        started=str(state.get("started", "")),
        idle_timeout=float(state.get("idle_timeout") or 0.0),
        stale=bool(state.get("stale")),
        socket=str(state.get("socket", "")),
        log=str(state.get("log", "")),
        merging=_object(state.get("merging")),
        stats=_object(state.get("stats")),
    )


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def list_workers() -> list[PooledWorker]:
    """The live pooled workers, oldest first; dead daemons' files are cleaned up.

    A file that is in the way of that clean-up is reported (a warning with the fix),
    and the listing goes on.
    """
    directory = ensure_pool_dir()
    alive = []
    for state in read_states(directory):
        if daemon_alive(state):
            alive.append(_record(state))
            continue
        try:
            clean_if_dead(PoolFiles(directory, str(state.get("id", ""))))
        except PoolFileError as exc:
            log.warning("could not clean up after a stopped worker: %s", exc)
    return alive


def start_worker(
    checkpoint: str,
    options: WorkerOptions,
    *,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    timeout: float | None = None,
) -> PooledWorker:
    """Start the pooled worker for ``checkpoint`` (or find it) and wait until it is ready.

    An already running daemon keeps its own idle timeout.
    """
    spec = resolve_worker_spec(checkpoint, options)
    key = worker_key(spec)
    stream, files = ensure_daemon(spec, key, timeout=timeout, idle_timeout=idle_timeout)
    stream.close()  # the daemon waits for real clients; this one only made sure
    state = read_pool_json(files.state)
    if state is None:
        raise WorkerTimeout(
            f"the pooled worker {key.digest} started but wrote no state file",
            hint="see its log in the pool directory, or run `rootstock workers list`",
        )
    return _record(state)


def select_workers(ids: list[str], workers: list[PooledWorker]) -> list[PooledWorker]:
    """The workers ``ids`` name (a unique prefix is enough); unknown ids are a UsageError."""
    chosen: list[PooledWorker] = []
    for wanted in ids:
        matches = [w for w in workers if w.id.startswith(wanted)] if wanted else []
        if len(matches) != 1:
            known = ", ".join(w.id for w in workers) or "none are running"
            what = "matches several pooled workers" if matches else "is no pooled worker"
            raise UsageError(
                f"{wanted!r} {what}; known ids: {known}",
                hint="see `rootstock workers list`, or stop them all with --all",
            )
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return chosen


def stop_workers(ids: list[str], *, all_workers: bool = False) -> list[PooledWorker]:
    """Stop the named pooled workers (or all of them); the ones stopped.

    Each daemon gets SIGTERM once its pid is checked to be that daemon still (the
    state file records the pid's start time); it closes its clients, stops its
    worker and removes its files. This waits for each to exit.
    """
    workers = list_workers()
    if all_workers:
        chosen = workers
    elif not ids:
        raise UsageError(
            "say which pooled workers to stop",
            hint="give an ID (see `rootstock workers list`) or --all",
        )
    else:
        chosen = select_workers(ids, workers)
    directory = ensure_pool_dir()
    for worker in chosen:
        files = PoolFiles(directory, worker.id)
        state = read_pool_json(files.state)
        if state is None or not daemon_alive(state) or worker.daemon_pid is None:
            continue  # it went on its own meanwhile
        try:
            os.kill(worker.daemon_pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        _wait_gone(state, worker.daemon_pid)
        clean_if_dead(files)
    return chosen


def _wait_gone(state: dict[str, Any], pid: int) -> None:
    deadline = time.monotonic() + STOP_WAIT_S
    while daemon_alive(state):
        if time.monotonic() >= deadline:
            # Its worker goes with it: the worker holds the daemon's lifeline.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)
