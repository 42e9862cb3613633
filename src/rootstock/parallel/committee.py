"""``rootstock.evaluate(images, checkpoints=[...])``: a committee over many structures.

Here, in this process, through one :class:`~rootstock.runtime.CommitteeCalculator`
(the same chunks to every member at once). On a Parsl or Dask executor each member
goes through the ordinary scale-out (:mod:`rootstock.parallel.dispatch`) in turn,
so an engine worker keeps one warm Rootstock worker per member (its warm cache is
keyed by the worker key), and the client combines the members' results per
structure. Either way the results are the per-structure dicts of the committee's
``calculate_batch``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rootstock.errors import UsageError, WorkerError
from rootstock.parallel.dispatch import check_executor, scale_out

if TYPE_CHECKING:
    from rootstock.runtime import CommitteeCalculator, Outcome

#: Keywords that go to calculate_batch rather than to the committee.
_BATCH_KEYWORDS = ("properties", "errors")


def evaluate_committee(
    images: Iterable[Any],
    checkpoint: str | None,
    device: str,
    executor: Any,
    batch_size: int | str,
    max_in_flight: int | None,
    start_timeout: float | None,
    calculator_kwargs: dict[str, Any],
) -> tuple[CommitteeCalculator, list[Outcome]]:
    """The committee (closed again) and every structure's committee result, in order."""
    from rootstock.runtime import DEFAULT_PROPERTIES, CommitteeCalculator

    checkpoints = calculator_kwargs.pop("checkpoints", None)
    if checkpoint is not None and checkpoints is not None:
        raise UsageError(
            "rootstock.evaluate takes checkpoint= (one model) or checkpoints=[...] "
            "(a committee), not both"
        )
    if checkpoints is None:
        raise UsageError(
            "rootstock.evaluate needs a checkpoint",
            hint="rootstock.evaluate(images, 'chgnet-0.3.0'), or checkpoints=[...] for a committee",
        )
    if executor is not None:
        check_executor(executor)
    batch = {k: calculator_kwargs.pop(k) for k in _BATCH_KEYWORDS if k in calculator_kwargs}
    batch.setdefault("properties", DEFAULT_PROPERTIES)
    calc = CommitteeCalculator(
        checkpoints, device=device, batch_size=batch_size, **calculator_kwargs
    )
    with calc:
        if executor is None:
            return calc, calc.calculate_batch(images, **batch)
        return calc, _on_executor(calc, images, executor, max_in_flight, start_timeout, batch)


def _on_executor(
    calc: CommitteeCalculator,
    images: Iterable[Any],
    executor: Any,
    max_in_flight: int | None,
    start_timeout: float | None,
    batch: dict[str, Any],
) -> list[Outcome]:
    """Each member's scale-out in turn, then the committee's result per structure.

    The input is read into a list first, since every member reads it.
    """
    from rootstock.runtime import plan_batch

    errors = batch.get("errors", "raise")
    listed = images if isinstance(images, list) else list(images)
    # Checked (UsageError) for the committee's own errors= before anything is sent.
    plan_batch(calc.members[calc.active[0]], listed, batch["properties"], errors=errors)
    per_member: dict[str, dict[int, Outcome]] = {}
    failed: dict[str, BaseException] = {}
    for member_id in list(calc.active):
        member = calc.members[member_id]
        plan = plan_batch(member, listed, batch["properties"], errors="return")
        try:
            per_member[member_id] = dict(
                scale_out(executor, member, plan, max_in_flight, start_timeout)
            )
        except Exception as exc:  # the member's engine run: raised or dropped below
            failed[member_id] = exc
    calc.settle_failures(failed)
    baseline: dict[str, float] = {}
    results: list[Outcome] = []
    for index in range(len(listed)):
        outcome = calc.combine_outcomes({m: got[index] for m, got in per_member.items()}, baseline)
        if errors == "raise" and isinstance(outcome, WorkerError):
            raise outcome
        results.append(outcome)
    return results
