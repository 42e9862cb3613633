"""The worker's side of a ``BATCH``: evaluate a chunk of structures, answer in one frame.

With the env's ``evaluate_batch(calc, atoms_list, properties)`` hook, the model
batches natively; without it the structures run one after another in-process on
a sibling :class:`ModelRunner` (the direct-calculate fast path and every result
check apply), which still saves a round trip per structure. Every result, from
either path, passes the same checks as a single call. A BATCH leaves the
single-call system (the last INIT) as it was.

What the hook receives and must return is documented in docs/protocol.md
("Batch frames") and docs/environments.md.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from rootstock.wire.batch import (
    BatchItem,
    BatchReply,
    BatchRequest,
    ItemError,
    ItemResult,
    encode_batchready,
)
from rootstock.wire.framing import EXTRA_PROPERTIES, encode_error, extra_array
from rootstock.worker.memory import is_out_of_memory
from rootstock.worker.model import (
    Evaluation,
    MalformedResult,
    ModelRunner,
    check_finite,
    checked_energy,
    checked_forces,
    checked_stress,
)

log = logging.getLogger("rootstock.worker")

#: ``evaluate_batch(calc, atoms_list, properties) -> list[dict | Exception]``.
BatchHook = Callable[[Any, list[Any], tuple[str, ...]], Any]


def run_batch(runner: ModelRunner, hook: BatchHook | None, request: BatchRequest) -> bytes:
    """The whole reply frame to ``request``: BATCHREADY, or ERROR if the chunk failed as a
    whole (a reply that cannot be encoded, say). Per-structure failures go in the reply."""
    natoms = [item.natoms for item in request.items]
    sized = hook is not None and request.memory is not None
    try:
        if sized:
            runner.chunk_sizer.take_report()  # only this batch's sub-batches are reported
        if hook is None:
            outcomes = _in_process(runner, request)
        else:
            outcomes = _with_hook(runner, hook, request)
        filled: frozenset[str] = frozenset()
        results: list[ItemResult | ItemError] = []
        for outcome in outcomes:
            if isinstance(outcome, tuple):
                results.append(outcome[0])
                filled |= outcome[1]
            else:
                results.append(outcome)
        memory = runner.chunk_sizer.take_report() if sized else None
        reply = BatchReply(results, runner.model_report(filled), memory)
        return encode_batchready(reply, natoms)
    except Exception as exc:
        log.error("a batch of %d structures failed as a whole: %s", len(natoms), exc)
        return encode_error(type(exc).__name__, str(exc), traceback_of(exc), "calculate")
    finally:
        runner.after_batch()


_Outcome = tuple[ItemResult, frozenset[str]] | ItemError


def traceback_of(exc: BaseException) -> str:
    """The text of ``exc``'s traceback; empty for a failed result check."""
    # A failed check would show only the worker's own code, never the model's.
    if isinstance(exc, MalformedResult):
        return ""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _item_error(exc: BaseException) -> ItemError:
    return ItemError(type(exc).__name__, str(exc), traceback_of(exc))


def _atoms_of(item: BatchItem) -> Any:
    from ase import Atoms

    atoms = Atoms(numbers=item.numbers, pbc=item.pbc, cell=item.cell, positions=item.positions)
    atoms.info.update(item.info)
    for name, values in item.arrays.items():
        atoms.set_array(name, values)
    return atoms


def _is_3d_periodic(item: BatchItem) -> bool:
    return bool(np.all(item.pbc) and all(np.any(v) for v in item.cell))


def _extras_asked(properties: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in EXTRA_PROPERTIES if n in properties)


# --- without a hook: one structure after another ---------------------------------------


def _in_process(runner: ModelRunner, request: BatchRequest) -> list[_Outcome]:
    sibling = runner.batch_sibling()
    sibling.allow_nonfinite = request.allow_nonfinite
    sibling.extras_wanted = _extras_asked(request.properties)
    sibling.lenient_stress = False
    stress = "stress" in request.properties
    forces = "forces" in request.properties
    outcomes: list[_Outcome] = []
    current: tuple | None = None
    for item in request.items:
        # As in a single call: stress only for cells periodic in all three directions.
        want_stress = stress and _is_3d_periodic(item)
        system = _system_key(item, want_stress)
        try:
            # A run of structures of one system (a screen of one composition) is a
            # trajectory to the model, as consecutive single calls are: only a new
            # system starts it clean, so its neighbour lists and caches carry over.
            if system != current:
                current = None
                sibling.start_system(_atoms_of(item), want_stress=want_stress)
                current = system
            evaluation = sibling.evaluate(item.cell, item.positions)
        except Exception as exc:
            current = None  # whatever the model kept after a failure is not trusted
            outcomes.append(_item_error(exc))
            continue
        outcomes.append((_from_evaluation(evaluation, forces), evaluation.filled))
    return outcomes


def _system_key(item: BatchItem, want_stress: bool) -> tuple:
    """What a single call's INIT carries: equal keys are one system to the model."""
    return (
        item.numbers.tobytes(),
        np.asarray(item.pbc).tobytes(),
        json.dumps(item.info, sort_keys=True),
        tuple((name, np.asarray(values).tobytes()) for name, values in sorted(item.arrays.items())),
        want_stress,
    )


def _from_evaluation(evaluation: Evaluation, forces: bool) -> ItemResult:
    # Copied: a model may hand out its own buffers and refill them for the next
    # structure, while a chunk's results wait to be encoded together.
    return ItemResult(
        energy=evaluation.energy,
        forces=evaluation.forces.copy() if forces else None,
        virial=evaluation.virial,
        free_energy=evaluation.free_energy,
        extras={name: value.copy() for name, value in evaluation.extras.items()},
    )


# --- with the env's evaluate_batch hook ----------------------------------------------


def _with_hook(runner: ModelRunner, hook: BatchHook, request: BatchRequest) -> list[_Outcome]:
    """The hook once per group of structures that share a request.

    Stress is asked for only for 3-D periodic structures (as in a single call), so
    when it is wanted the periodic ones go in one call and the others in a second
    call whose ``properties`` leave it out. With the request's ``memory`` bound, a
    group goes in sub-batches that fit it (:mod:`rootstock.worker.memory`).
    """
    properties = request.properties
    items = request.items
    groups: list[tuple[list[int], tuple[str, ...]]]
    if "stress" in properties:
        periodic = [i for i, item in enumerate(items) if _is_3d_periodic(item)]
        others = [i for i, item in enumerate(items) if not _is_3d_periodic(item)]
        without = tuple(p for p in properties if p != "stress")
        groups = [(periodic, properties), (others, without)]
    else:
        groups = [(list(range(len(items))), properties)]
    outcomes: list[_Outcome | None] = [None] * len(items)
    for indices, group_properties in groups:
        built = []
        for i in indices:
            try:
                built.append((i, _atoms_of(items[i])))
            except Exception as exc:
                outcomes[i] = _item_error(exc)
        if not built:
            continue
        atoms_list = [atoms for _, atoms in built]
        if request.memory is None:
            entries = _call_hook(runner.calc, hook, atoms_list, group_properties)
        else:
            evaluate = hook_evaluator(runner.calc, hook, group_properties)
            entries = runner.chunk_sizer.run(atoms_list, evaluate, request.memory)
        for (i, atoms), entry in zip(built, entries, strict=True):
            try:
                outcomes[i] = _checked_entry(
                    entry, atoms, group_properties, request.allow_nonfinite
                )
            except Exception as exc:
                outcomes[i] = _item_error(exc)
    return [o for o in outcomes if o is not None]


def hook_evaluator(
    calc: Any, hook: BatchHook, properties: tuple[str, ...]
) -> Callable[[list[Any]], list[Any]]:
    """The ``evaluate`` a :class:`~rootstock.worker.memory.ChunkSizer` runs: the hook on
    a sub-batch, with this module's one-at-a-time rerun of a whole failure, except that
    running out of memory escapes, so the sizer halves the sub-batch first."""

    def evaluate(atoms_list: list[Any]) -> list[Any]:
        return _call_hook(calc, hook, atoms_list, properties, memory_errors_escape=True)

    return evaluate


def _call_hook(
    calc: Any,
    hook: BatchHook,
    atoms_list: list[Any],
    properties: tuple[str, ...],
    memory_errors_escape: bool = False,
) -> list[Any]:
    """The hook's entries, one per structure; a hook that fails as a whole (raises,
    or returns something other than a list of the right length) is run again one
    structure at a time, so the failure lands on the structure that causes it.
    With ``memory_errors_escape``, an out-of-memory error of the whole call is
    raised instead, for the caller to halve the call."""
    try:
        entries = _hook_list(hook(calc, atoms_list, properties), len(atoms_list))
    except Exception as exc:
        if memory_errors_escape and is_out_of_memory(exc):
            raise
        if len(atoms_list) == 1:
            return [exc]
        log.warning(
            "evaluate_batch failed on %d structures (%s: %s); running them one at a time",
            len(atoms_list),
            type(exc).__name__,
            exc,
        )
    else:
        return entries
    entries = []
    for atoms in atoms_list:
        try:
            entries.extend(_hook_list(hook(calc, [atoms], properties), 1))
        except Exception as exc:
            entries.append(exc)
    return entries


def _hook_list(value: Any, count: int) -> list[Any]:
    if not isinstance(value, list):
        raise MalformedResult(
            f"evaluate_batch returned {type(value).__name__}, not a list of {count} results"
        )
    if len(value) != count:
        raise MalformedResult(
            f"evaluate_batch returned {len(value)} results for {count} structures"
        )
    return value


def _checked_entry(
    entry: Any, atoms: Any, properties: tuple[str, ...], allow_nonfinite: bool
) -> tuple[ItemResult, frozenset[str]]:
    """One hook entry, checked as a single call's results are; raises what failed."""
    if isinstance(entry, BaseException):
        raise entry
    if not isinstance(entry, dict):
        raise MalformedResult(
            f"evaluate_batch gave {type(entry).__name__} for a structure, "
            "not a dict of results or an exception"
        )
    natoms = len(atoms)
    for name in ("energy", *(p for p in ("forces", "stress") if p in properties)):
        if entry.get(name) is None:
            raise MalformedResult(f"evaluate_batch gave no {name!r} for a structure")
    energy = checked_energy("energy", entry["energy"])
    result = ItemResult(energy=energy)
    if "forces" in properties:
        result.forces = checked_forces(entry["forces"], natoms).copy()
    stress = checked_stress(entry["stress"]) if "stress" in properties else None
    if stress is not None:
        result.virial = -atoms.get_volume() * stress
    free = entry.get("free_energy")
    if free is not None:
        free = checked_energy("free_energy", free)
        if free != energy:
            result.free_energy = free
    if not allow_nonfinite:
        check_finite("energy", energy)
        if result.forces is not None:
            check_finite("forces", result.forces)
        if stress is not None:
            check_finite("stress", stress)
        if free is not None:
            check_finite("free_energy", free)
    for name in _extras_asked(properties):
        if entry.get(name) is not None:
            try:
                result.extras[name] = extra_array(name, entry[name], natoms).copy()
            except ValueError as exc:
                raise MalformedResult(str(exc)) from None
    filled = frozenset(n for n in EXTRA_PROPERTIES if entry.get(n) is not None)
    return result, filled


def evaluate_items(runner: ModelRunner, hook: BatchHook, request: BatchRequest) -> list[_Outcome]:
    """Each item's outcome through the hook, in order: ``(ItemResult, filled)`` or an
    ``ItemError``. The pool daemon's merged single calls (:mod:`rootstock.worker.merge`)
    are computed here, by the same path and checks as a ``BATCH``."""
    return _with_hook(runner, hook, request)
