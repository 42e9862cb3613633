"""In-flight batching in the pool daemon: which waiting calls go to the worker together.

While the worker computes, the clients' requests queue in arrival order. The next
turn at the worker takes the request at the head, and when that is a single call
that may be merged (:attr:`Queued.mergeable`), every other mergeable single call
waiting, up to :attr:`MergePolicy.max_calls` calls and :attr:`MergePolicy.max_atoms`
atoms, in arrival order. A client's own ``BATCH`` always goes alone, as one unit. So
a lone client is never held back (with ``max_wait_ms`` 0, the default, a request
that finds the worker idle goes at once), and a waiting request is passed by at
most one merged batch: the next turn starts at the head of the queue.

The daemon reads two variables from its environment (that of the process that
started it): ``ROOTSTOCK_POOL_MERGE=0`` turns merging off (one call per turn, as
before it existed) and ``ROOTSTOCK_POOL_MAX_WAIT_MS`` holds a request that finds the
worker idle for up to that long, to gather more (less when every connected client
already has a request waiting).
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

MERGE_ENV = "ROOTSTOCK_POOL_MERGE"
MAX_WAIT_ENV = "ROOTSTOCK_POOL_MAX_WAIT_MS"
#: The most calls, and atoms, one merged batch holds (a client's calculate_batch
#: chunk is 64 structures by default).
MAX_CALLS = 64
MAX_ATOMS = 1 << 16
#: How many queue waits the percentiles are taken over (the most recent ones).
WAITS_KEPT = 4096


class Queued(Protocol):
    """What the policy reads of a waiting request."""

    @property
    def mergeable(self) -> bool: ...

    @property
    def natoms(self) -> int: ...

    @property
    def arrived(self) -> float: ...


Q = TypeVar("Q", bound=Queued)


@dataclass(frozen=True)
class MergePolicy:
    """Whether calls are merged, how many at most, and how long a lone one may wait."""

    enabled: bool = True
    max_wait_s: float = 0.0
    max_calls: int = MAX_CALLS
    max_atoms: int = MAX_ATOMS

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> MergePolicy:
        """The policy the daemon's environment asks for; a malformed value is ignored
        (the daemon runs detached, so it logs nothing a user would see)."""
        merge = (os.environ if environ is None else environ).get(MERGE_ENV, "1")
        enabled = merge.strip().lower() not in ("0", "false", "no", "off")
        try:
            wait_ms = float((os.environ if environ is None else environ).get(MAX_WAIT_ENV) or 0)
        except ValueError:
            wait_ms = 0.0
        if not 0.0 <= wait_ms <= 10_000.0:
            wait_ms = 0.0
        return cls(enabled=enabled, max_wait_s=wait_ms / 1000.0)

    def gathering(
        self, queue: collections.deque[Q], worker_merges: bool | None, clients: int
    ) -> float:
        """How long the head of ``queue`` may wait for company (0: go now): nothing once
        the turn is full, or once each of the ``clients`` connected has a request
        queued (a client has one request at a time, so nobody else can come)."""
        if not self.merges(queue, worker_merges) or self.max_wait_s <= 0:
            return 0.0
        if len(queue) >= clients or sum(1 for q in queue if q.mergeable) >= self.max_calls:
            return 0.0
        return self.max_wait_s

    def merges(self, queue: collections.deque[Q], worker_merges: bool | None) -> bool:
        """Whether the head of ``queue`` may take company."""
        return bool(self.enabled and worker_merges and queue and queue[0].mergeable)

    def take(self, queue: collections.deque[Q], worker_merges: bool | None) -> list[Q]:
        """Remove and return the next turn's requests (see the module docstring)."""
        if not self.merges(queue, worker_merges):
            return [queue.popleft()]
        taken: list[Q] = []
        atoms = 0
        for request in queue:
            if not request.mergeable:
                continue
            if taken and (len(taken) >= self.max_calls or atoms + request.natoms > self.max_atoms):
                break
            taken.append(request)
            atoms += request.natoms
        for request in taken:
            queue.remove(request)
        return taken


def _percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@dataclass
class PoolStats:
    """What ``rootstock workers list`` reports of a pooled worker's traffic.

    ``requests``: calls and client batches answered by the worker; ``batches``: turns
    at the worker; ``merged``: turns that carried two or more single calls. The batch
    sizes are the single calls per turn; queue waits run from a request's arrival to
    its turn.
    """

    requests: int = 0
    batches: int = 0
    merged: int = 0
    calls: int = 0
    call_turns: int = 0
    largest: int = 0
    waits: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=WAITS_KEPT)
    )
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_turn(self, waits: list[float], singles: int) -> None:
        """One turn at the worker: each request's queue wait, and how many single calls
        it carried (0 for a client's own BATCH)."""
        with self.lock:
            self.requests += len(waits)
            self.batches += 1
            self.waits.extend(waits)
            if singles:
                self.calls += singles
                self.call_turns += 1
                self.largest = max(self.largest, singles)
            if singles > 1:
                self.merged += 1
            self.version += 1

    def summary(self) -> dict[str, Any]:
        """The counters as JSON: ``queue_wait_ms`` p50 and p99 over the recent waits."""
        with self.lock:
            waits = list(self.waits)
            mean = self.calls / self.call_turns if self.call_turns else None
            summary: dict[str, Any] = {
                "requests": self.requests,
                "batches": self.batches,
                "merged_batches": self.merged,
                "batch_size_mean": mean,
                "batch_size_max": self.largest,
            }
        summary["queue_wait_ms"] = {
            "p50": _milliseconds(_percentile(waits, 0.50)),
            "p99": _milliseconds(_percentile(waits, 0.99)),
        }
        return summary


def _milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
