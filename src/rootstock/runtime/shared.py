"""The in-process registry of shared workers: who holds which worker, and its lock.

Calculators of one process whose worker keys are equal
(:func:`rootstock.runtime.worker_keys.worker_key`) hold one :class:`SharedWorker`:
the session (a spawned worker, or an attachment to the user's pool), the lock that
lets one caller at a time send a request and read its reply, and the last model
report any holder received. Each calculator's hold is a :class:`Lease`; the entry
counts them, and the last one released stops the worker.

The session inside an entry is replaced when it dies or times out (the session
stops itself then), so every holder's next call starts or attaches afresh, and
they all land on the one new worker.

The registry is per process: a forked child starts with an empty one (and new
locks, since a lock held by another thread at the fork would never be released in
the child), so it never sends to, or stops, its parent's workers.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from rootstock.runtime.session import WorkerSession

_registry_lock = threading.RLock()
_entries: dict[Hashable, SharedWorker] = {}


class SharedWorker:
    """One worker session, the lock for its calls, and the calculators that hold it.

    ``key`` is None for a worker of one calculator's own (``shared=False``), which
    goes through the same code but is never found by another calculator.
    """

    def __init__(self, key: Hashable | None) -> None:
        self.key = key
        # Reentrant: a finalizer that releases a lease may run, from the garbage
        # collector, inside a call that already holds it.
        self.lock = threading.RLock()
        self.session: WorkerSession | None = None
        self.holders = 0
        # A holder whose first call needs no INIT gets no model report from the
        # worker; it learns it from the one another holder received.
        self.model_report: dict[str, Any] | None = None

    @property
    def alive(self) -> bool:
        """True while the session has a live worker."""
        session = self.session
        return session is not None and session.alive

    def live_session(self, start: Callable[[], WorkerSession]) -> WorkerSession:
        """The running session, started with ``start`` if there is none (hold the lock)."""
        session = self.session
        if session is None or not session.alive:
            self.session = None
            session = self.session = start()
        return session

    def stop(self) -> None:
        """Stop the worker (holders' next call starts a new one)."""
        with self.lock:
            session, self.session = self.session, None
            if session is not None:
                session.close()


class Lease:
    """One calculator's hold on a :class:`SharedWorker`, valid in the process that took it."""

    def __init__(self, entry: SharedWorker) -> None:
        self.entry = entry
        self.pid = os.getpid()
        self.released = False

    @property
    def key(self) -> Hashable | None:
        return self.entry.key

    @property
    def stale(self) -> bool:
        """True in a process forked after the lease was taken."""
        return self.pid != os.getpid()


class Holder:
    """One calculator's side: its lease, taken at the first call and re-taken as needed.

    The calculator that owns it must never be referenced from here (the finalizer
    that drops the lease when the calculator is collected would keep it alive).
    """

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self._finalizer: weakref.finalize | None = None

    def entry(self, owner: object, key_now: Callable[[], Hashable | None]) -> SharedWorker:
        """The entry to call through, joining (or re-joining) for ``key_now()``."""
        lease = self.lease
        if lease is not None and lease.stale:
            # Forked: the parent's worker is not ours to use; start or find our own.
            self.leave()
            lease = None
        # A call on a dead worker spawns anyway: spawn for the key as it is now, so a
        # hotfix made since the last join is not served under the old key.
        if (
            lease is not None
            and lease.key is not None
            and not lease.entry.alive
            and key_now() != lease.key
        ):
            self.leave()
            lease = None
        if lease is None:
            lease = self.lease = join(key_now())
            # Garbage collection drops the hold too. At exit the session's own
            # finalizer stops the worker, so this one need not run then.
            self._finalizer = weakref.finalize(owner, release, lease)
            self._finalizer.atexit = False
        return lease.entry

    @property
    def session(self) -> WorkerSession | None:
        """The session held now (shared with the other holders), if any."""
        lease = self.lease
        return lease.entry.session if lease is not None and not lease.stale else None

    @property
    def model_report(self) -> dict[str, Any] | None:
        """The last model report any holder of this worker received."""
        lease = self.lease
        return lease.entry.model_report if lease is not None and not lease.stale else None

    @model_report.setter
    def model_report(self, report: dict[str, Any]) -> None:
        lease = self.lease
        if lease is not None and not lease.stale:
            lease.entry.model_report = report

    def distrust(self, session: WorkerSession) -> None:
        """Stop a worker that sent garbage, for every holder (if it is still the one)."""
        lease = self.lease
        if lease is None or lease.stale:
            session.close()
            return
        entry = lease.entry
        # Checked and cleared under the entry's lock: another holder may have
        # replaced the session since, and that fresh one must not be stopped.
        with entry.lock:
            if entry.session is session:
                entry.session = None
        session.close()

    def leave(self) -> None:
        """Let go of the worker (the last holder's leaving stops it)."""
        lease, self.lease = self.lease, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if lease is not None:
            release(lease)


def join(key: Hashable | None) -> Lease:
    """Hold the shared worker for ``key`` (made if none is held); None: a private one."""
    if key is None:
        entry = SharedWorker(None)
        entry.holders = 1
        return Lease(entry)
    with _registry_lock:
        found = _entries.get(key)
        if found is None:
            found = _entries[key] = SharedWorker(key)
        found.holders += 1
        return Lease(found)


def release(lease: Lease) -> None:
    """Drop ``lease``; the last holder's release stops the worker. Idempotent.

    A lease from before a fork is only forgotten: the worker is the parent's.
    """
    entry = lease.entry
    with _registry_lock:
        # Checked and set under the lock: two threads closing one calculator at once
        # must not both count its release, or the worker stops under other holders.
        if lease.released:
            return
        lease.released = True
        if not lease.stale:
            entry.holders -= 1
            if entry.holders > 0:
                return
            if entry.key is not None and _entries.get(entry.key) is entry:
                del _entries[entry.key]
    if lease.stale:
        abandon(entry)
        return
    entry.stop()


def abandon(entry: SharedWorker) -> None:
    """Forget a parent's entry in a forked child without touching the parent's worker."""
    session, entry.session = entry.session, None
    if session is not None:
        # In a forked child close() only drops this process's copy of the connection.
        session.close()


def held_keys() -> list[Hashable]:
    """The keys of the shared workers this process holds now (for tests and debugging)."""
    with _registry_lock:
        return list(_entries)


def _after_fork_in_child() -> None:
    global _registry_lock, _entries
    # Leases in the child still point at the old entries and find themselves stale.
    _registry_lock = threading.RLock()
    _entries = {}


os.register_at_fork(after_in_child=_after_fork_in_child)
