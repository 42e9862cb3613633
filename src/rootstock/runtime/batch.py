"""Many structures through one worker, one round trip per chunk.

:func:`iter_batch` is the engine: it reads ``images`` lazily, cuts it into chunks
(at most ``batch_size`` structures and ``max_atoms_per_chunk`` atoms; a larger
structure goes alone), sends each chunk as one ``BATCH`` frame and yields
``(index, result)`` in input order, so memory on both sides stays bounded by a
chunk. With ``batch_size="auto"`` (the default) the count is only a generous cap
and the ``BATCH`` asks the worker to run its model in sub-batches that fit a
memory budget (``max_memory``; :mod:`rootstock.worker.memory`).
:func:`calculate_batch` (``RootstockCalculator.calculate_batch``) collects it into a
list, and ``rootstock.evaluate`` (:mod:`rootstock.parallel.evaluation`)
wraps a calculator around that, here or on a Parsl or Dask executor. Units and
keys are those of ``calc.results``; see docs/calculator.md.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rootstock.errors import (
    ProtocolError,
    UsageError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeout,
)
from rootstock.runtime.session import FORWARDED_ARRAYS, model_error
from rootstock.runtime.structure import info_json, is_3d_periodic, stress_from_virial
from rootstock.wire.batch import BatchItem, BatchRequest, ItemError, ItemResult, MemoryLimit
from rootstock.wire.framing import EXTRA_PROPERTIES, MAX_PAYLOAD, ErrorReply, extra_array

if TYPE_CHECKING:
    from rootstock.runtime.calculator import RootstockCalculator

DEFAULT_PROPERTIES = ("energy", "forces", "stress")
#: What ``properties`` may name: ``free_energy`` comes with ``energy``.
KNOWN_PROPERTIES = ("energy", "free_energy", "forces", "stress", *EXTRA_PROPERTIES)
ERROR_MODES = ("raise", "return")
# A BATCH body costs 28 bytes per atom and its reply at most ~64 (forces and every
# extra), so no chunk may hold more atoms than this however the calculator is set.
# One structure above it is sent as a single call instead.
WIRE_ATOMS_PER_CHUNK = MAX_PAYLOAD // 128

#: ``batch_size="auto"``: chunks sized by memory in the worker.
AUTO = "auto"
#: Structures per chunk for a fixed count's old default, and for "auto" until the
#: worker has answered with a memory report: a worker built before memory sizing
#: runs a whole chunk in one model call, so it never gets more than it used to.
FIXED_CHUNK_STRUCTURES = 64
#: Structures per chunk with "auto" once the worker sizes its model calls itself:
#: the cap then bounds only the client's memory and the wire, never the model's.
AUTO_CHUNK_STRUCTURES = 256
# An integer max_memory is bytes; below this it is surely a fraction meant as 1.
_LEAST_MEMORY_BYTES = 1 << 20
_MEMORY_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
_MEMORY_TEXT = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*|%)$")
_MEMORY_HINT = (
    "max_memory takes a fraction of the device's memory (a float, 0 < f <= 1), a size "
    "in bytes (an integer, at least 1 MiB), or a string such as '4GB', '512MiB' or "
    "'25%'; None leaves the worker's default (half the free GPU memory, a quarter "
    "of the available RAM)"
)

Outcome = dict[str, Any] | WorkerError
#: What ``batch_size`` takes: ``"auto"`` or a positive integer.
BatchSize = int | str


def _checked_properties(properties: Iterable[str]) -> tuple[str, ...]:
    if isinstance(properties, str):
        properties = (properties,)
    try:
        names = tuple(properties)
    except TypeError:
        raise UsageError(
            f"properties must be a list of property names, not {type(properties).__name__}",
            hint=f"known properties: {', '.join(KNOWN_PROPERTIES)}",
        ) from None
    unknown = [n for n in names if n not in KNOWN_PROPERTIES]
    if unknown:
        raise UsageError(
            f"unknown propert{'y' if len(unknown) == 1 else 'ies'} "
            f"{', '.join(map(repr, unknown))} for calculate_batch",
            hint=f"known properties: {', '.join(KNOWN_PROPERTIES)}",
        )
    if not names:
        raise UsageError(
            "calculate_batch needs at least one property",
            hint=f"known properties: {', '.join(KNOWN_PROPERTIES)}",
        )
    return names


def checked_batch_size(batch_size: Any) -> BatchSize:
    """``"auto"`` or a positive integer, else UsageError."""
    if isinstance(batch_size, str) and batch_size == AUTO:
        return AUTO
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise UsageError(
            f"batch_size must be a positive integer or 'auto', not {batch_size!r}",
            hint="'auto' (the default) lets the worker size its model calls by memory; "
            "an integer N sends chunks of at most N structures, each as one model call",
        )
    return batch_size


def _memory_error(value: Any, why: str = "") -> UsageError:
    return UsageError(f"max_memory {value!r} is not a memory bound{why}", hint=_MEMORY_HINT)


def checked_max_memory(value: Any) -> MemoryLimit:
    """The worker's memory budget from a user's ``max_memory``, else UsageError:
    None (the worker's default), a fraction of the device's total memory, bytes,
    or text such as ``"4GB"``, ``"512MiB"`` or ``"25%"``."""
    if value is None:
        return MemoryLimit()
    if isinstance(value, str):
        match = _MEMORY_TEXT.match(value.strip().lower())
        if match is None or match.group(2) not in (*_MEMORY_UNITS, "%"):
            raise _memory_error(value)
        number, unit = float(match.group(1)), match.group(2)
        if unit == "%":
            if not 0 < number <= 100:
                raise _memory_error(value, " (a share must be above 0% and at most 100%)")
            return MemoryLimit(fraction=number / 100)
        if unit == "":
            return checked_max_memory(number)
        return checked_max_memory(round(number * _MEMORY_UNITS[unit]))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _memory_error(value)
    if isinstance(value, numbers.Integral):
        if int(value) < _LEAST_MEMORY_BYTES:
            raise _memory_error(value, " (an integer is bytes, and this is under 1 MiB)")
        return MemoryLimit(nbytes=int(value))
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise _memory_error(value)
    if number <= 1:
        return MemoryLimit(fraction=number)
    if number.is_integer():
        return checked_max_memory(int(number))
    raise _memory_error(value, " (a float above 1 is neither a fraction nor whole bytes)")


def _checked_atoms(index: int, item: Any) -> Any:
    from ase import Atoms

    if not isinstance(item, Atoms):
        raise UsageError(
            f"images[{index}] is {type(item).__module__}.{type(item).__name__}, not ase.Atoms",
            hint="calculate_batch takes an iterable of ase.Atoms",
        )
    return item


@dataclass(frozen=True)
class BatchPlan:
    """A checked batch request: the structures still to read, how to cut them, and the
    memory bound each chunk's ``BATCH`` carries (None: a fixed count, as before)."""

    images: Iterator[Any]
    properties: tuple[str, ...]
    batch_size: int
    max_atoms: int
    raise_errors: bool
    memory: MemoryLimit | None = None

    def chunks(
        self, worker_sizes: Callable[[], bool] | None = None
    ) -> Iterator[list[tuple[int, Any]]]:
        """Lists of ``(index, atoms)``, read lazily (see :func:`chunks`).

        With a memory bound, a chunk holds at most FIXED_CHUNK_STRUCTURES until
        ``worker_sizes()`` says the worker has answered with a memory report;
        without that callable (engine tasks, spread over many workers) it always does.
        """
        if self.memory is None:
            return chunks(self.images, self.batch_size, self.max_atoms)
        grown, fixed = self.batch_size, min(self.batch_size, FIXED_CHUNK_STRUCTURES)

        def size() -> int:
            return grown if worker_sizes is not None and worker_sizes() else fixed

        return chunks(self.images, size, self.max_atoms)


def plan_batch(
    calc: RootstockCalculator,
    images: Iterable[Any],
    properties: Iterable[str] = DEFAULT_PROPERTIES,
    batch_size: BatchSize | None = None,
    errors: str = "raise",
    max_memory: Any = None,
) -> BatchPlan:
    """Check the arguments of a batch call before anything is sent (UsageError).

    For a list or tuple every item is checked too; for any other iterable each
    item is checked as it is reached. ``batch_size`` and ``max_memory`` left None
    are the calculator's.
    """
    from ase import Atoms

    names = _checked_properties(properties)
    size = checked_batch_size(calc.batch_size if batch_size is None else batch_size)
    memory = planned_memory(size, max_memory, calc.max_memory)
    if errors not in ERROR_MODES:
        raise UsageError(
            f"errors must be 'raise' or 'return', not {errors!r}",
            hint="'return' puts each failure's WorkerError in its slot and keeps the rest",
        )
    if isinstance(images, Atoms):
        raise UsageError(
            "calculate_batch takes an iterable of structures, not one ase.Atoms",
            hint="pass [atoms], or use atoms.get_potential_energy() for a single structure",
        )
    try:
        iterator = iter(images)
    except TypeError:
        raise UsageError(
            f"images must be an iterable of ase.Atoms, not {type(images).__name__}"
        ) from None
    if isinstance(images, list | tuple):
        for index, item in enumerate(images):
            _checked_atoms(index, item)
    max_atoms = min(calc.max_atoms_per_chunk, WIRE_ATOMS_PER_CHUNK)
    count = size if isinstance(size, int) else AUTO_CHUNK_STRUCTURES
    return BatchPlan(iterator, names, count, max_atoms, errors == "raise", memory)


def planned_memory(size: BatchSize, asked: Any, calculators: Any) -> MemoryLimit | None:
    """The memory bound a batch's chunks carry (``asked`` in this call, else the
    calculator's): only with ``"auto"``. A ``max_memory`` asked for with a fixed
    count is a contradiction, refused (UsageError), as is a malformed one."""
    if size != AUTO:
        if asked is not None:
            raise UsageError(
                f"max_memory applies to batch_size='auto', not batch_size={size!r}",
                hint="drop batch_size (it defaults to 'auto') to bound chunks by memory, "
                "or drop max_memory to keep chunks of a fixed count",
            )
        return None
    return checked_max_memory(calculators if asked is None else asked)


def iter_batch(
    calc: RootstockCalculator,
    images: Iterable[Any],
    properties: Iterable[str] = DEFAULT_PROPERTIES,
    batch_size: BatchSize | None = None,
    errors: str = "raise",
    max_memory: Any = None,
) -> Iterator[tuple[int, Outcome]]:
    """Yield ``(index, result)`` for every structure of ``images``, in input order.

    The arguments are checked before anything is sent (:func:`plan_batch`). A
    failing structure raises WorkerError naming its index, once its chunk's reply
    has been read (``errors="raise"``), or is yielded as that WorkerError
    (``errors="return"``). A worker death or timeout ends the iteration with
    WorkerDiedError or WorkerTimeout.
    """
    return stream_batch(calc, plan_batch(calc, images, properties, batch_size, errors, max_memory))


def stream_batch(calc: RootstockCalculator, plan: BatchPlan) -> Iterator[tuple[int, Outcome]]:
    """``(index, result)`` for a checked plan, in input order (see :func:`iter_batch`)."""
    for chunk in plan.chunks(lambda: calc.memory_report is not None):
        for index, outcome in run_chunk(calc, chunk, plan.properties, plan.memory):
            if plan.raise_errors and isinstance(outcome, WorkerError):
                raise outcome
            yield index, outcome


def chunks(
    images: Iterator[Any], size: int | Callable[[], int], max_atoms: int
) -> Iterator[list[tuple[int, Any]]]:
    """Lists of ``(index, atoms)``: at most ``size`` structures (asked of ``size()``
    for each chunk when it is a callable) and ``max_atoms`` atoms, except that a
    structure larger than ``max_atoms`` makes a chunk of its own."""
    chunk: list[tuple[int, Any]] = []
    atoms_in_chunk = 0
    limit = 0
    for index, item in enumerate(images):
        atoms = _checked_atoms(index, item)
        n = len(atoms)
        if chunk and atoms_in_chunk + n > max_atoms:
            yield chunk
            chunk, atoms_in_chunk = [], 0
        if not chunk:
            # Asked as each chunk starts: the previous chunk's reply may have changed it.
            limit = size() if callable(size) else size
        chunk.append((index, atoms))
        atoms_in_chunk += n
        # A full chunk goes at once: a generator is never read ahead of what is sent.
        if len(chunk) >= limit or atoms_in_chunk >= max_atoms:
            yield chunk
            chunk, atoms_in_chunk = [], 0
    if chunk:
        yield chunk


def _refused_locally(index: int, atoms: Any) -> WorkerError | None:
    """Structures no model can be given: decided here, without sending them."""
    if len(atoms) == 0:
        return WorkerError(f"structure {index} has no atoms")
    if not (np.isfinite(atoms.positions).all() and np.isfinite(atoms.cell.array).all()):
        return WorkerError(
            f"structure {index} has NaN or inf in its positions or cell",
            hint="check how the structure was made; the model was not called",
        )
    return None


def _batch_item(atoms: Any) -> BatchItem:
    text = info_json(atoms.info)
    return BatchItem(
        numbers=atoms.arrays["numbers"],
        pbc=atoms.pbc,
        cell=atoms.cell.array,
        positions=atoms.arrays["positions"],
        info={} if text == "{}" else json.loads(text),
        arrays={n: atoms.arrays[n] for n in FORWARDED_ARRAYS if n in atoms.arrays},
    )


def run_chunk(
    calc: RootstockCalculator,
    chunk: list[tuple[int, Any]],
    names: tuple[str, ...],
    memory: MemoryLimit | None = None,
) -> list[tuple[int, Outcome]]:
    """One chunk's outcomes, in order: one BATCH round trip for what can be sent.

    The indices are the caller's (a scale-out task keeps the input's own); model
    failures come back as WorkerError in their slots, never raised. With ``memory``
    the worker runs the chunk in sub-batches that fit it, and its report is left
    in ``calc.memory_report``.
    """
    outcomes: dict[int, Outcome] = {}
    sent: list[tuple[int, Any]] = []
    for index, atoms in chunk:
        refused = _refused_locally(index, atoms)
        if refused is not None:
            outcomes[index] = refused
        else:
            sent.append((index, atoms))
    if len(sent) == 1 and len(sent[0][1]) > WIRE_ATOMS_PER_CHUNK:
        index, atoms = sent[0]
        outcomes[index] = _single_call(calc, index, atoms, names)
    elif sent:
        wire = tuple(dict.fromkeys("energy" if n == "free_energy" else n for n in names))
        request = BatchRequest(
            [_batch_item(atoms) for _, atoms in sent], wire, calc.allow_nonfinite, memory
        )
        with calc._using_worker() as session:
            reply = session.compute_batch(request, timeout=calc.timeout)
            if reply.model is not None:
                calc._learn_model(reply.model)
            # None from a worker built before memory sizing, or one without a hook.
            calc.memory_report = reply.memory if memory is not None else None
            for (index, atoms), result in zip(sent, reply.results, strict=True):
                if isinstance(result, ItemError):
                    outcomes[index] = model_error(
                        calc.spec,
                        ErrorReply(result.type, result.message, result.traceback, "calculate"),
                        index,
                    )
                else:
                    outcomes[index] = _result_dict(result, atoms, names)
    return [(index, outcomes[index]) for index, _ in chunk]


def _result_dict(result: ItemResult, atoms: Any, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "energy" in names or "free_energy" in names:
        out["energy"] = result.energy
        out["free_energy"] = result.energy if result.free_energy is None else result.free_energy
    if "forces" in names:
        if result.forces is None:
            raise ProtocolError("the worker's BATCHREADY lacks forces that were asked for")
        out["forces"] = result.forces.copy()
    if "stress" in names and is_3d_periodic(atoms):
        if result.virial is None:
            raise ProtocolError("the worker's BATCHREADY lacks a stress that was asked for")
        out["stress"] = stress_from_virial(result.virial, atoms)
    for name in EXTRA_PROPERTIES:
        if name in names and name in result.extras:
            out[name] = result.extras[name].copy()
    return out


def _single_call(
    calc: RootstockCalculator, index: int, atoms: Any, names: tuple[str, ...]
) -> Outcome:
    """A structure too large for a BATCH frame, as one ordinary calculation."""
    want_stress = "stress" in names and is_3d_periodic(atoms)
    extras = tuple(n for n in EXTRA_PROPERTIES if n in names)
    try:
        with calc._using_worker() as session:
            reply = session.compute(
                atoms, info_json(atoms.info), want_stress, extras, timeout=calc.timeout
            )
    except (WorkerDiedError, WorkerTimeout):
        raise
    except WorkerError as exc:
        return WorkerError(
            f"structure {index}: {exc.message}", remote_traceback=exc.remote_traceback,
            hint=exc.hint,
        )  # fmt: skip
    extra = reply.extra_json()
    result = ItemResult(
        energy=reply.energy,
        forces=reply.forces,
        virial=reply.virial if want_stress else None,
        free_energy=float(extra["free_energy"]) if "free_energy" in extra else None,
    )
    for name in extras:
        if name in extra:
            try:
                result.extras[name] = extra_array(name, extra[name], len(atoms))
            except ValueError as exc:
                raise ProtocolError(f"the worker sent a malformed extra: {exc}") from None
    return _result_dict(result, atoms, names)


def calculate_batch(
    calc: RootstockCalculator,
    images: Iterable[Any],
    properties: Iterable[str] = DEFAULT_PROPERTIES,
    batch_size: BatchSize | None = None,
    errors: str = "raise",
    max_memory: Any = None,
) -> list[Outcome]:
    """Every structure's results as a list in input order (see :func:`iter_batch`).

    If the worker dies, the WorkerDiedError's ``partial_results`` holds the
    results finished before the chunk in flight: ``images[:len(partial_results)]``.
    """
    results: list[Outcome] = []
    try:
        for _, outcome in iter_batch(calc, images, properties, batch_size, errors, max_memory):
            results.append(outcome)
    except WorkerDiedError as exc:
        exc.partial_results = results
        raise
    return results
