"""``rootstock.evaluate`` and ``rootstock.evaluate_iter``: many structures, one checkpoint.

Without an executor they run :func:`~rootstock.runtime.calculate_batch` in
one calculator of this process. With a Parsl or Dask executor, chunks become
engine tasks (:mod:`rootstock.parallel.dispatch`), each engine worker keeping one
warm Rootstock worker. The engines are imported only for that; see
docs/scale-out.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

from rootstock.errors import UsageError
from rootstock.parallel.dispatch import check_executor, scale_out
from rootstock.runtime import DEFAULT_PROPERTIES, plan_batch, stream_batch

if TYPE_CHECKING:
    from rootstock.runtime import Outcome, Provenance, RootstockCalculator

#: How long ``evaluate`` with an executor waits for its first chunk before it asks
#: the engine why nothing runs (a job still queued, or refused); see docs/scale-out.md.
DEFAULT_START_TIMEOUT = 1800.0


class Evaluation(NamedTuple):
    """What ``rootstock.evaluate(..., provenance=True)`` returns: ``results, provenance``."""

    #: Exactly what ``evaluate`` returns without ``provenance=True``.
    results: list[Outcome]
    #: :attr:`RootstockCalculator.provenance <rootstock.RootstockCalculator.provenance>`
    #: of the calculator that ran them; its ``device`` is None with an executor (each
    #: engine worker ran the model on its own device).
    provenance: Provenance


def _evaluation(
    images: Iterable[Any],
    checkpoint: str,
    device: str,
    executor: Any,
    batch_size: int | str,
    max_in_flight: int | None,
    start_timeout: float | None,
    calculator_kwargs: dict[str, Any],
) -> tuple[RootstockCalculator, Iterator[tuple[int, Outcome]]]:
    """The calculator and the checked ``(index, result)`` stream behind :func:`evaluate`
    and :func:`evaluate_iter`: in input order locally, as completed on an executor."""
    from rootstock.runtime import RootstockCalculator

    properties = calculator_kwargs.pop("properties", DEFAULT_PROPERTIES)
    errors = calculator_kwargs.pop("errors", "raise")
    accepted = inspect.signature(RootstockCalculator).parameters
    unknown = sorted(k for k in calculator_kwargs if k not in accepted or k == "checkpoint")
    if unknown:
        raise UsageError(
            f"rootstock.evaluate got unknown keyword(s) {', '.join(unknown)}",
            hint="it takes properties=, errors=, max_in_flight=, start_timeout= and "
            "RootstockCalculator's keywords: "
            + ", ".join(k for k in accepted if k not in ("checkpoint", "device", "batch_size")),
        )
    if executor is not None:
        check_executor(executor)
    # Resolving the calculator checks the checkpoint (installed, fetched) before any
    # engine starts or any job is submitted; no worker starts here.
    calc = RootstockCalculator(
        checkpoint, device=device, batch_size=batch_size, **calculator_kwargs
    )
    plan = plan_batch(calc, images, properties, errors=errors)
    if executor is None:
        return calc, _closing(calc, stream_batch(calc, plan))
    return calc, scale_out(executor, calc, plan, max_in_flight, start_timeout)


def _closing(
    calc: RootstockCalculator, stream: Iterator[tuple[int, Outcome]]
) -> Iterator[tuple[int, Outcome]]:
    with calc:
        yield from stream


@overload
def evaluate(
    images: Iterable[Any],
    checkpoint: str | None = ...,
    device: str = ...,
    executor: Any = ...,
    batch_size: int | str = ...,
    max_in_flight: int | None = ...,
    start_timeout: float | None = ...,
    *,
    provenance: Literal[False] = ...,
    **calculator_kwargs: Any,
) -> list[Outcome]: ...


@overload
def evaluate(
    images: Iterable[Any],
    checkpoint: str | None = ...,
    device: str = ...,
    executor: Any = ...,
    batch_size: int | str = ...,
    max_in_flight: int | None = ...,
    start_timeout: float | None = ...,
    *,
    provenance: Literal[True],
    **calculator_kwargs: Any,
) -> Evaluation: ...


def evaluate(
    images: Iterable[Any],
    checkpoint: str | None = None,
    device: str = "cpu",
    executor: Any = None,
    batch_size: int | str = "auto",
    max_in_flight: int | None = None,
    start_timeout: float | None = DEFAULT_START_TIMEOUT,
    *,
    provenance: bool = False,
    **calculator_kwargs: Any,
) -> list[Outcome] | Evaluation:
    """Every structure's results with ``checkpoint``, as a list in input order.

    ``executor=None`` evaluates in one calculator in this process, then closes it.
    A Parsl ``Config`` or ``DataFlowKernel``, or a Dask ``distributed.Client``,
    spreads chunks of ``batch_size`` structures (64 with ``"auto"``) over the
    engine's workers, each holding one warm Rootstock worker (see
    docs/scale-out.md); ``max_in_flight`` bounds the chunks submitted at once
    (default: two per engine worker), and
    ``start_timeout`` is how long to wait for the first chunk before the engine is
    asked why nothing runs. ``properties=`` and ``errors=`` are those of
    :func:`~rootstock.runtime.calculate_batch`; every other keyword goes to
    :class:`~rootstock.runtime.RootstockCalculator`. ``batch_size="auto"`` (the
    default) lets each worker run its model in sub-batches that fit ``max_memory``
    (a calculator keyword: a fraction of the device's memory, bytes, or ``"4GB"``);
    an integer is a fixed count per chunk, each one model call.

    ``provenance=True`` returns an :class:`Evaluation` instead, ``(results,
    provenance)``: the same list, and the calculator's provenance once beside it.
    """
    if not isinstance(provenance, bool):
        raise UsageError(f"provenance must be True or False, not {provenance!r}")
    if checkpoint is None or "checkpoints" in calculator_kwargs:
        # A committee (checkpoints=[...]): rootstock.parallel.committee.
        from rootstock.parallel.committee import evaluate_committee

        committee, outcomes = evaluate_committee(
            images, checkpoint, device, executor, batch_size, max_in_flight, start_timeout,
            calculator_kwargs,
        )  # fmt: skip
        if provenance:  # each member's provenance, by checkpoint id
            return Evaluation(outcomes, committee.provenance)  # type: ignore[arg-type]  # {id: Provenance}
        return outcomes
    calc, stream = _evaluation(
        images, checkpoint, device, executor, batch_size, max_in_flight, start_timeout,
        calculator_kwargs,
    )  # fmt: skip
    if executor is None:
        results = [outcome for _, outcome in stream]
    else:
        slots: dict[int, Outcome] = dict(stream)
        results = [slots[i] for i in range(len(slots))]
    if not provenance:
        return results
    return Evaluation(results, calc.provenance)


def evaluate_iter(
    images: Iterable[Any],
    checkpoint: str,
    device: str = "cpu",
    executor: Any = None,
    batch_size: int | str = "auto",
    max_in_flight: int | None = None,
    start_timeout: float | None = DEFAULT_START_TIMEOUT,
    **calculator_kwargs: Any,
) -> Iterator[tuple[int, Outcome]]:
    """Like :func:`evaluate`, but yields ``(index, result)`` as each chunk finishes.

    Locally that is input order; on an executor it is completion order, and only
    the chunks in flight are held, so an input of any length streams through. The
    arguments and the checkpoint are checked on the call, before the first
    ``next()``; closing the iterator early cancels the chunks still in flight.
    """
    _, stream = _evaluation(
        images, checkpoint, device, executor, batch_size, max_in_flight, start_timeout,
        calculator_kwargs,
    )  # fmt: skip
    return stream
