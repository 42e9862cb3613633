"""The worker's side of ``RSMERGE``: several clients' single calls as one model batch.

The pool daemon sends ``RSMERGE`` (``int32`` k) followed by k single calls exactly
as a client writes them, each an optional ``INIT``, a ``POSDATA`` and a
``GETFORCE``. The worker treats them as those calls made one after another: each
``INIT`` becomes the current system (so after the merge the worker's single-call
system is the last one sent, as the daemon assumes), and each ``GETFORCE`` gets the
reply it would have got alone, ``FORCEREADY`` or ``ERROR``, written back in order.
Only the computing differs: every structure goes to the env's ``evaluate_batch``
hook together (:func:`rootstock.worker.batch.evaluate_items`), in sub-batches that
fit the worker's default memory budget as a ``batch_size="auto"`` chunk does
(:mod:`rootstock.worker.memory`), and a structure that fails fails alone.

A worker advertises this with ``"merge": true`` in its model report, which it sends
only when the env has an ``evaluate_batch`` hook; a worker built before ``RSMERGE``
never sends it, so the daemon never sends it the frame.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rootstock.errors import ProtocolError
from rootstock.wire.batch import BatchItem, BatchRequest, ItemError, MemoryLimit
from rootstock.wire.framing import (
    MAX_MERGE,
    FrameStream,
    Init,
    PosData,
    encode_error,
    encode_forceready,
    read_init_body,
    read_posdata_body,
)
from rootstock.worker.batch import traceback_of
from rootstock.worker.model import ARRAYS_FORWARDED, Evaluation, ModelRunner

log = logging.getLogger("rootstock.worker")

#: ``(runner, hook, request) -> one outcome per item``: the batch path's evaluation.
EvaluateItems = Callable[[ModelRunner, Any, BatchRequest], list[Any]]


@dataclass(frozen=True)
class MergedCall:
    """One client's single call inside an ``RSMERGE``: its INIT (if sent) and geometry."""

    init: Init | None
    pos: PosData


@dataclass(frozen=True)
class MergeRequest:
    """A decoded ``RSMERGE``: the single calls, in the order they are answered."""

    calls: list[MergedCall]


def read_merge_body(stream: FrameStream) -> MergeRequest:
    """The body of an ``RSMERGE`` (after its header): k, then k calls.

    Anything but ``[INIT] POSDATA GETFORCE`` per call is a ProtocolError: only the
    pool daemon sends this frame, and a daemon out of step must not be guessed at.
    """
    count = stream.read_int32()
    if not 1 <= count <= MAX_MERGE:
        raise ProtocolError(f"an RSMERGE declares {count} calls (allowed: 1 to {MAX_MERGE})")
    calls = []
    for _ in range(count):
        word = stream.read_header()
        init = None
        if word == "INIT":
            init = read_init_body(stream)
            word = stream.read_header()
        if word != "POSDATA":
            raise ProtocolError(f"an RSMERGE call holds {word} where POSDATA belongs")
        pos = read_posdata_body(stream)
        word = stream.read_header()
        if word != "GETFORCE":
            raise ProtocolError(f"an RSMERGE call holds {word} where GETFORCE belongs")
        calls.append(MergedCall(init, pos))
    return MergeRequest(calls)


@dataclass
class _Pending:
    """A call whose system is known: the structure to compute and how to ask for it."""

    index: int
    item: BatchItem
    properties: tuple[str, ...]
    allow_nonfinite: bool


def run_merge(
    runner: ModelRunner, hook: Any, request: MergeRequest, evaluate_items: EvaluateItems
) -> list[bytes]:
    """One reply frame per call, in order (see the module docstring)."""
    due = runner.report_due  # read before the INITs below set it
    replies: list[bytes | None] = [None] * len(request.calls)
    inits: list[bool] = []
    pending: list[_Pending] = []
    for index, call in enumerate(request.calls):
        inits.append(call.init is not None)
        if call.init is not None:
            problem = _configure(runner, call.init)
            if problem is not None:
                replies[index] = problem
                continue
        try:
            pending.append(_pending(runner, index, call.pos))
        except Exception as exc:
            replies[index] = _error_frame(exc, "calculate")
    try:
        outcomes = _evaluate(runner, hook, pending, evaluate_items)
    finally:
        runner.after_batch()
    return _encode(runner, due, replies, inits, outcomes)


def _configure(runner: ModelRunner, init: Init) -> bytes | None:
    """Apply one call's INIT as a single call would; its ERROR frame if that failed."""
    try:
        config = init.dialect_config()
        if config is None:
            raise ProtocolError("an RSMERGE call carries a standard i-PI INIT")
        runner.configure(config)
    except Exception as exc:
        return _error_frame(exc, "init")
    return None


def _pending(runner: ModelRunner, index: int, pos: PosData) -> _Pending:
    """The call's structure in the current system, checked as ``runner.evaluate`` checks."""
    atoms = runner.atoms
    if atoms is None:
        raise RuntimeError("GETFORCE for a system whose INIT failed or never came")
    if len(pos.positions) != len(atoms):
        raise ValueError(
            f"the server sent {len(pos.positions)} atoms, but the structure has {len(atoms)}"
        )
    arrays = {name: atoms.arrays[name].copy() for name in ARRAYS_FORWARDED if name in atoms.arrays}
    item = BatchItem(
        numbers=atoms.numbers.copy(),
        pbc=atoms.pbc.copy(),
        cell=pos.cell,
        positions=pos.positions,
        info=dict(atoms.info),
        arrays=arrays,
    )
    properties = ("energy", "forces", *(("stress",) if runner.want_stress else ()))
    return _Pending(index, item, (*properties, *runner.extras_wanted), runner.allow_nonfinite)


def _evaluate(
    runner: ModelRunner, hook: Any, pending: list[_Pending], evaluate_items: EvaluateItems
) -> dict[int, Any]:
    """Each pending call's outcome, by call index: one batch per way of asking."""
    groups: dict[tuple[tuple[str, ...], bool], list[_Pending]] = {}
    for call in pending:
        groups.setdefault((call.properties, call.allow_nonfinite), []).append(call)
    outcomes: dict[int, Any] = {}
    for (properties, allow_nonfinite), calls in groups.items():
        # Sized by memory, as a batch_size="auto" chunk is: the worker's default budget.
        batch = BatchRequest([c.item for c in calls], properties, allow_nonfinite, MemoryLimit())
        try:
            results = evaluate_items(runner, hook, batch)
        except Exception as exc:
            log.error("a merged batch of %d calls failed as a whole: %s", len(calls), exc)
            results = [ItemError(type(exc).__name__, str(exc), "")] * len(calls)
        finally:
            runner.chunk_sizer.take_report()  # nobody reads it: the replies are single
        for call, outcome in zip(calls, results, strict=True):
            outcomes[call.index] = outcome
    return outcomes


def _encode(
    runner: ModelRunner,
    due: bool,
    replies: list[bytes | None],
    inits: list[bool],
    outcomes: dict[int, Any],
) -> list[bytes]:
    """The reply frames in call order. The model report goes out as it would have in
    single calls (``due``: one was owed before the first): in the first reply after
    each INIT, and when a new extra is filled."""
    frames = []
    for index, reply in enumerate(replies):
        due = due or inits[index]
        if reply is None:
            outcome = outcomes[index]
            if isinstance(outcome, ItemError):
                reply = encode_error(outcome.type, outcome.message, outcome.traceback, "calculate")
            else:
                result, filled = outcome
                evaluation = Evaluation(
                    energy=result.energy,
                    forces=result.forces,
                    virial=result.virial,
                    free_energy=result.free_energy,
                    extras=result.extras,
                    filled=filled,
                )
                runner.report_due = due
                virial = np.zeros((3, 3)) if result.virial is None else result.virial
                reply = encode_forceready(
                    result.energy, result.forces, virial, runner.extra_bytes(evaluation)
                )
                due = runner.report_due
        frames.append(reply)
    runner.report_due = due
    return frames


def _error_frame(exc: BaseException, phase: str) -> bytes:
    """The ERROR a single call would have got for ``exc`` in ``phase``."""
    return encode_error(type(exc).__name__, str(exc), traceback_of(exc), phase)
