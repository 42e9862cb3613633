"""Sub-batches that fit in memory: the worker's side of ``batch_size="auto"``.

A BATCH whose JSON carries ``memory`` (docs/protocol.md) does not reach the model
as one call: the worker's :class:`ChunkSizer` cuts it into sub-batches whose
predicted peak memory fits a budget. On its first use it probes the model with
growing sub-batches (1, 2, then 4 structures) of the caller's own structures,
measures each call's peak memory growth, and fits a bound ``base + per_atom *
atoms`` that every later measurement refines for the worker's life. A sub-batch
that runs out of memory anyway is halved and retried, down to single structures,
and the atom count that failed caps every later sub-batch. docs/calculator.md
("Chunks that fit in memory") is the user's view.

Like all of ``worker/``, this runs inside model envs: it needs only the standard
library and ``wire/`` (torch is used when the model has imported it, never
imported here).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rootstock.wire.batch import MemoryLimit

log = logging.getLogger("rootstock.worker")

T = TypeVar("T")

#: ``evaluate(atoms_list) -> list``: one model call, one result (or Exception) per structure.
Evaluate = Callable[[list[Any]], list[Any]]

#: The probe's sub-batch sizes, in structures, run on the worker's first sized batches.
PROBE_SIZES = (1, 2, 4)
#: Measured sub-batches the fit keeps (the most recent), so a one-off cost fades out.
KEPT_POINTS = 16
#: Sub-batches one memory report lists at most (the most recent).
REPORTED_RUNS = 1024
#: Default budgets: this share of the free GPU memory, or of the available RAM.
GPU_SHARE = 0.5
RAM_SHARE = 0.25
#: Sub-batches are planned to this share of the budget: the rest is headroom for
#: what the fit cannot see (the allocator's noise, a structure denser than those
#: measured), so that a measured peak stays within the budget itself.
PLAN_SHARE = 0.9
# Measuring costs a heap trim and a page-table reset per model call (for CHGNet on
# four 8-atom cells, 0.29 s on top of a 0.22 s call), so once the bound rests on this
# many measured calls, a call predicted under this share of the budget runs
# unmeasured; near the budget every call is still measured.
SETTLED_POINTS = 3
SETTLED_SHARE = 0.5
# A cgroup v1 "no limit" is a page-rounded 2**63; anything this large is no limit.
_UNLIMITED = 1 << 60


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the model ran out of memory: MemoryError, torch's
    OutOfMemoryError, or a RuntimeError whose text says so (older torch, other
    accelerators' runtimes)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


# --- the bound and the plan: pure functions ---------------------------------------------


@dataclass(frozen=True)
class LinearBound:
    """Peak memory growth of one model call, in bytes: ``base + per_atom * atoms``."""

    base: float
    per_atom: float

    def predict(self, atoms: int) -> float:
        return self.base + self.per_atom * atoms


def fit_bound(points: Sequence[tuple[int, int]]) -> LinearBound | None:
    """An upper bound over measured ``(atoms, peak bytes)`` points, or None without any.

    The slope is the least-squares one, never negative; the base is then the
    smallest that leaves every point on or under the line, so noise errs on the
    safe side (a smaller sub-batch, not an out-of-memory error). With one size
    seen, all of the memory is taken as per atom, which over-predicts larger
    sub-batches rather than under-predicting them.
    """
    if not points:
        return None
    atoms = [a for a, _ in points]
    if min(atoms) == max(atoms):
        return LinearBound(0.0, max(p for _, p in points) / atoms[0])
    mean_a = sum(atoms) / len(points)
    mean_p = sum(p for _, p in points) / len(points)
    spread = sum((a - mean_a) ** 2 for a in atoms)
    slope = max(0.0, sum((a - mean_a) * (p - mean_p) for a, p in points) / spread)
    base = max(0.0, max(p - slope * a for a, p in points))
    return LinearBound(base, slope)


def fitting_count(
    natoms: Sequence[int], bound: LinearBound | None, budget: int | None, max_atoms: int | None
) -> int:
    """How many structures (of ``natoms``, from the front) the next sub-batch takes:
    as many as keep its predicted peak within ``budget`` and its atoms within
    ``max_atoms``, and at least one, since a structure cannot be split."""
    total = 0
    for count, n in enumerate(natoms):
        total += n
        if count and (
            (max_atoms is not None and total > max_atoms)
            or (bound is not None and budget is not None and bound.predict(total) > budget)
        ):
            return count
    return len(natoms)


# --- meters: what a call's peak was, and what the budget is -------------------------------


class Meter(Protocol):
    """Measures one call's peak memory growth on the model's device, and sets the budget."""

    name: str

    def budget(self, limit: MemoryLimit) -> int | None:
        """The bytes a sub-batch may add, or None when nothing says."""
        ...

    def measure(self, call: Callable[[], T]) -> tuple[T, int | None]:
        """``call()``'s value and its peak growth in bytes (None: not measurable)."""
        ...

    def release(self) -> None:
        """Hand back what a failed call left cached, before the retry."""
        ...


def _kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """``Name:  N kB`` lines of a /proc file, in bytes."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in names:
                    out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory() -> tuple[int | None, int | None]:
    """The tightest cgroup memory limit over this process's cgroup and its parents,
    and the room left under it, in bytes (None: no limit).

    A batch job's memory is its cgroup's (SLURM confines jobs that way), not the
    node's, so MemAvailable alone would promise memory the job cannot have.
    """
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    limits: list[int] = []
    rooms: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2
            base, limit_file, usage_file = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        # In a cgroup namespace the listed path is not under the mount: its root is ours.
        here = base / path.lstrip("/")
        for directory in (here, *here.parents):
            if not directory.is_relative_to(base):
                break
            limit = _read_int(directory / limit_file)
            usage = _read_int(directory / usage_file)
            if limit is not None and limit < _UNLIMITED:
                limits.append(limit)
                if usage is not None:
                    rooms.append(max(0, limit - usage))
    return (min(limits) if limits else None), (min(rooms) if rooms else None)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc


def _trim_heap() -> None:
    """glibc's malloc_trim(0): freed heap pages go back to the kernel (elsewhere a no-op)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class RssMeter:
    """Peak growth of this process's resident memory during a call (Linux).

    Writing ``5`` to /proc/self/clear_refs (Linux 4.0+) resets the kernel's
    high-water mark VmHWM to the current RSS, so VmHWM after the call is that
    call's own peak, however the call freed its memory before returning.
    ``ru_maxrss`` cannot be reset (it says nothing once an earlier call went
    higher), and sampling misses short peaks. Before the reset, glibc's heap is
    trimmed (``malloc_trim``), so that memory a call reuses from freed heap pages
    counts as growth: glibc keeps a freed buffer of a few MB in its heap, and
    without the trim the next call that reuses it shows no growth at all. The
    trim can make a call re-fault heap pages it would have found resident, which
    errs on the high side.
    Where the reset is refused the meter measures nothing ("none"), and only the
    halving on MemoryError bounds a sub-batch.
    """

    def __init__(self) -> None:
        self.name = "rss" if self._reset_peak() else "none"

    @staticmethod
    def _reset_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")
        except OSError:
            return False
        return True

    def budget(self, limit: MemoryLimit) -> int | None:
        if limit.nbytes is not None:
            return limit.nbytes
        info = _kib_fields("/proc/meminfo", ("MemTotal", "MemAvailable"))
        cg_limit, cg_room = cgroup_memory()
        if limit.fraction is not None:
            total = min(v for v in (info.get("MemTotal"), cg_limit, 1 << 62) if v is not None)
            return int(limit.fraction * total) if total < 1 << 62 else None
        room = min(v for v in (info.get("MemAvailable"), cg_room, 1 << 62) if v is not None)
        return int(RAM_SHARE * room) if room < 1 << 62 else None

    def measure(self, call: Callable[[], T]) -> tuple[T, int | None]:
        if self.name == "none":
            return call(), None
        _trim_heap()
        reset = self._reset_peak()
        before = _kib_fields("/proc/self/status", ("VmRSS",)).get("VmRSS")
        value = call()
        peak = _kib_fields("/proc/self/status", ("VmHWM",)).get("VmHWM")
        if not reset or before is None or peak is None:
            return value, None
        return value, max(0, peak - before)

    def release(self) -> None:
        gc.collect()


class CudaMeter:
    """Peak growth of torch's allocated CUDA memory during a call, on the model's device."""

    name = "cuda"

    def __init__(self, torch: Any, device: str) -> None:
        self.torch = torch
        self.device = torch.device(device)

    def budget(self, limit: MemoryLimit) -> int | None:
        cuda = self.torch.cuda
        if limit.nbytes is not None:
            return limit.nbytes
        free, total = cuda.mem_get_info(self.device)
        if limit.fraction is not None:
            return int(limit.fraction * total)
        # What torch's caching allocator holds unused is free to this process too.
        cached = cuda.memory_reserved(self.device) - cuda.memory_allocated(self.device)
        return int(GPU_SHARE * (free + max(0, cached)))

    def measure(self, call: Callable[[], T]) -> tuple[T, int | None]:
        cuda = self.torch.cuda
        cuda.synchronize(self.device)
        cuda.reset_peak_memory_stats(self.device)
        before = cuda.memory_allocated(self.device)
        value = call()
        cuda.synchronize(self.device)
        return value, max(0, cuda.max_memory_allocated(self.device) - before)

    def release(self) -> None:
        gc.collect()
        self.torch.cuda.empty_cache()


def meter_for(device: str | None) -> Meter:
    """CUDA's allocator statistics for a model on a CUDA device (when the model has
    imported torch), else this process's peak RSS."""
    torch = sys.modules.get("torch")
    if device is not None and device.startswith("cuda") and torch is not None:
        try:
            if torch.cuda.is_available():
                return CudaMeter(torch, device)
        except Exception as exc:  # a broken CUDA runtime: measure RSS rather than fail
            log.warning("cannot read CUDA memory statistics (%s); measuring RSS", exc)
    return RssMeter()


# --- the sizer -------------------------------------------------------------------------


@dataclass(frozen=True)
class SubBatchRun:
    """One model call the sizer made: its size, measured peak and predicted peak (bytes)."""

    structures: int
    atoms: int
    peak: int | None
    predicted: int | None
    out_of_memory: bool = False


class ChunkSizer:
    """Runs a worker's batches in sub-batches that fit a memory budget; one per worker.

    What it learns (the fitted bound, the atom count that ran out of memory) is
    kept for the worker's life, so only the first sized batch pays for the probe.
    """

    def __init__(self, device: str | None = None, meter: Meter | None = None) -> None:
        self.meter = meter if meter is not None else meter_for(device)
        self.bound: LinearBound | None = None
        #: The most atoms a sub-batch may hold, set when one ran out of memory.
        self.max_atoms: int | None = None
        self.budget: int | None = None
        self._points: deque[tuple[int, int]] = deque(maxlen=KEPT_POINTS)
        self._warmup: tuple[int, int] | None = None
        self._probes = list(PROBE_SIZES)
        self._runs: deque[SubBatchRun] = deque(maxlen=REPORTED_RUNS)
        self._halvings = 0

    def run(
        self, atoms_list: Sequence[Any], evaluate: Evaluate, limit: MemoryLimit | None = None
    ) -> list[Any]:
        """One entry per structure of ``atoms_list``, in order: what ``evaluate`` gave
        for it, or the out-of-memory exception of a single structure that did not fit.

        ``evaluate(sub_list)`` is one model call (the env's ``evaluate_batch`` hook)
        and returns a list with one result or Exception per structure. An
        out-of-memory error it raises halves the sub-batch; any other exception
        propagates. ``limit`` is the BATCH's ``memory`` field (None: the default).
        """
        self.budget = self.meter.budget(limit if limit is not None else MemoryLimit())
        planned = None if self.budget is None else int(PLAN_SHARE * self.budget)
        natoms = [len(atoms) for atoms in atoms_list]
        entries: list[Any] = []
        start = 0
        while start < len(natoms):
            count = fitting_count(natoms[start:], self.bound, planned, self.max_atoms)
            if self._probes:
                count = min(count, self._probes.pop(0))
            entries.extend(self._attempt(list(atoms_list[start : start + count]), evaluate))
            start += count
        return entries

    def _attempt(self, sub: list[Any], evaluate: Evaluate) -> list[Any]:
        """``sub``'s entries from one call, or from its halves when it ran out of memory."""
        atoms = sum(len(a) for a in sub)
        predicted = None if self.bound is None else int(self.bound.predict(atoms))
        measured = self._measures(predicted)
        try:
            if measured:
                entries, peak = self.meter.measure(lambda: evaluate(sub))
            else:
                entries, peak = evaluate(sub), None
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            self._out_of_memory(len(sub), atoms, predicted)
            if len(sub) == 1:
                self.meter.release()
                return [exc]
        else:
            if not isinstance(entries, list) or len(entries) != len(sub):
                raise ValueError(
                    f"evaluate gave {type(entries).__name__} for {len(sub)} structures, "
                    "not a list of one entry per structure"
                )
            if measured:
                self._learn(len(sub), atoms, peak, predicted)
            else:
                self._runs.append(SubBatchRun(len(sub), atoms, None, predicted))
            return entries
        # Past the except block, the error and the frames (tensors) it held are gone.
        self.meter.release()
        half = (len(sub) + 1) // 2
        return self._attempt(sub[:half], evaluate) + self._attempt(sub[half:], evaluate)

    def _measures(self, predicted: int | None) -> bool:
        """Whether this call is measured: while the bound is being learned, and for a
        call predicted near the budget (see SETTLED_SHARE)."""
        if self.bound is None or len(self._points) < SETTLED_POINTS or predicted is None:
            return True
        return self.budget is None or predicted > SETTLED_SHARE * self.budget

    def _out_of_memory(self, structures: int, atoms: int, predicted: int | None) -> None:
        self._halvings += 1
        self._runs.append(SubBatchRun(structures, atoms, None, predicted, out_of_memory=True))
        cap = max(1, atoms // 2)
        self.max_atoms = cap if self.max_atoms is None else min(self.max_atoms, cap)
        self._probes.clear()  # the cap says more than a larger probe would
        log.warning(
            "a sub-batch of %d structures (%d atoms) ran out of memory; at most %d atoms "
            "per model call from now on",
            structures,
            atoms,
            self.max_atoms,
        )

    def _learn(self, structures: int, atoms: int, peak: int | None, predicted: int | None) -> None:
        self._runs.append(SubBatchRun(structures, atoms, peak, predicted))
        if peak is None:
            self._probes.clear()  # nothing to fit: only the halving bounds a sub-batch
            return
        if self._warmup is None:
            # The worker's first measured call also pays one-off costs (lazy imports,
            # caches, kernels): it counts only until two others say more.
            self._warmup = (atoms, peak)
        else:
            self._points.append((atoms, peak))
        points = list(self._points) if len(self._points) >= 2 else [self._warmup, *self._points]
        self.bound = fit_bound(points)

    def take_report(self) -> dict[str, Any]:
        """The BATCHREADY ``memory`` report: what the sizer knows, and the sub-batches
        it ran since the last report (which this call starts afresh)."""
        bound = self.bound
        report = {
            "meter": self.meter.name,
            "budget": self.budget,
            "base": None if bound is None else int(bound.base),
            "per_atom": None if bound is None else bound.per_atom,
            "max_atoms": self.max_atoms,
            "halvings": self._halvings,
            "batches": [asdict(run) for run in self._runs],
        }
        self._runs.clear()
        self._halvings = 0
        return report
