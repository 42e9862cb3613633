"""CommitteeCalculator: several checkpoints on the same structures at once, with their spread.

Each member is an ordinary :class:`~rootstock.runtime.calculator.RootstockCalculator`
(the same spawn path, sharing, pool and staging rules), so a committee adds no
process of its own. Its members compute **concurrently**: a call hands every
member its request on a small thread pool that lives as long as the committee
(one thread per member) before any reply is awaited. Threads are enough because
a member's call is a write to its worker's Unix socket and a wait for the reply,
both of which release the GIL; the models run in their own processes, so a call
costs about the slowest member, not the sum. The numbers are
:mod:`rootstock.runtime.committee_stats`'s.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from rootstock.errors import RootstockError, UsageError, WorkerDiedError, WorkerError
from rootstock.runtime.batch import DEFAULT_PROPERTIES, Outcome, plan_batch, run_chunk
from rootstock.runtime.calculator import RootstockCalculator
from rootstock.runtime.committee_stats import combine
from rootstock.runtime.structure import info_json, is_3d_periodic

MEMBER_ERROR_MODES = ("raise", "drop")
_T = TypeVar("_T")
# Keywords of RootstockCalculator the committee sets per member, or itself.
_PER_MEMBER = ("checkpoint", "setup_kwargs", "weights")


class _Threads:
    """The committee's thread pool, made on first use; shared with its finalizer."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.lock = threading.Lock()

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        with self.lock:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.size, thread_name_prefix="rootstock-committee"
                )
            return self.pool

    def shutdown(self) -> None:
        with self.lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def _close_all(members: list[RootstockCalculator], threads: _Threads) -> None:
    """Stop the thread pool and let go of every member's worker (never raises)."""
    threads.shutdown()
    for member in members:
        try:
            member.close()
        except Exception:  # one member's failed stop must not keep the others up
            continue


def _checked_members(checkpoints: Any) -> list[str]:
    if isinstance(checkpoints, str):
        raise UsageError(
            f"checkpoints must be a list of checkpoint ids, not the string {checkpoints!r}",
            hint=f"CommitteeCalculator([{checkpoints!r}, ...]) with at least two ids, or "
            "RootstockCalculator for one model",
        )
    try:
        ids = list(checkpoints)
    except TypeError:
        raise UsageError(
            f"checkpoints must be a list of checkpoint ids, not {type(checkpoints).__name__}"
        ) from None
    if not ids:
        raise UsageError(
            "a committee needs at least one checkpoint",
            hint="CommitteeCalculator(['chgnet-0.3.0', 'sevennet-0'], device='cpu')",
        )
    bad = [i for i in ids if not isinstance(i, str) or not i]
    if bad:
        raise UsageError(f"checkpoint ids must be non-empty strings, not {bad[0]!r}")
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise UsageError(
            f"checkpoint(s) {', '.join(map(repr, repeated))} named more than once in the committee",
            hint="each member is one checkpoint id; list each id once",
        )
    return ids


def _per_member(name: str, value: Any, ids: list[str]) -> dict[str, Any]:
    """``weights`` or ``setup_kwargs``: a dict keyed by member id (None: none)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UsageError(
            f"{name} must map member ids to their values, not {type(value).__name__}",
            hint=f"{name}={{{ids[0]!r}: ...}}: each member gets its own",
        )
    unknown = [k for k in value if k not in ids]
    if unknown:
        raise UsageError(
            f"{name} names {', '.join(map(repr, unknown))}, which "
            f"{'is not a member' if len(unknown) == 1 else 'are not members'} of the committee "
            f"({', '.join(ids)})",
            hint=f"{name} maps each member's checkpoint id to its own value, e.g. "
            f"{name}={{{ids[0]!r}: ...}}",
        )
    return dict(value)


def _name_member(exc: BaseException, member: str) -> BaseException:
    """``exc`` with its message prefixed by the member's id; its type is kept."""
    if isinstance(exc, RootstockError):
        exc.message = f"committee member {member!r}: {exc.message}"
        exc.args = (exc.message, *exc.args[1:])
    else:
        exc.add_note(f"raised by committee member {member!r}")
    exc.committee_member = member  # type: ignore[attr-defined]  # for callers that branch on it
    return exc


def _droppable(exc: BaseException) -> bool:
    """A member's failure (its model, its worker), not a mistake every member shares."""
    return isinstance(exc, RootstockError) and not isinstance(exc, UsageError)


def _member_single(
    member: RootstockCalculator, atoms: Any, names: tuple[str, ...]
) -> dict[str, Any]:
    """One member's energy, forces (and stress) for ``atoms``, in one calculation.

    Stress is asked for first: the member then computes it with the forces in one
    round trip, and the other names come from its results.
    """
    for name in names:
        member.get_property(name, atoms)
    return dict(member.results)


def _member_chunk(
    member: RootstockCalculator, chunk: list[tuple[int, Any]], names: tuple[str, ...], memory: Any
) -> list[tuple[int, Outcome]]:
    return run_chunk(member, chunk, names, memory)


class CommitteeCalculator(Calculator):
    """Several checkpoints on the same structures, concurrently, with their spread.

    Parameters
    ----------
    checkpoints:
        The members' checkpoint ids (``rootstock list``), each once.
    device:
        Passed to every member's ``setup()``.
    weights, setup_kwargs:
        Per member: dicts keyed by checkpoint id (``weights={"mace:custom":
        "model.pt"}``, ``setup_kwargs={"chgnet-0.3.0": {...}}``).
    reference:
        None: ``energy``, ``free_energy``, ``forces`` and ``stress`` are the
        members' means. A member's id: they are that member's own values (MD
        driven by one trusted model while the others watch); the spreads are
        reported either way. The reference member is never dropped.
    on_member_error:
        ``"raise"`` (the default): a member's failure fails the call with the
        member's own error type (a ``WorkerDiedError`` stays one), its message
        starting with ``committee member 'ID':``; the other members' workers stay
        up. ``"drop"``: the call goes on with the other members, and the failed
        member stays out of this calculator from then on (``calc.dropped``;
        ``results["dropped"]``). At least one member must remain, else the first
        failure is raised.
    **member_options:
        Every other keyword of :class:`~rootstock.runtime.calculator.RootstockCalculator`
        (``root``, ``cluster``, ``cache_root``, ``timeout``, ``shared``, ``pool``,
        ``stage``, ``batch_size``, ``max_memory``, ...), given to every member.

    Results (``calc.results`` after a call; every array float64)
    -------------------------------------------------------------
    ``energy``, ``free_energy``, ``forces``, ``stress``:
        the members' means, or the reference member's values.
    ``energy_std``:
        the population standard deviation (``ddof=0``) of the members' energies.
        Models put their zero of energy in different places, so this mixes those
        offsets with disagreement: compare it between structures only for members
        of one family.
    ``energy_std_relative``:
        the spread of each member's energy minus its own energy on the baseline
        structure: the first structure this calculator computed since it was made
        or since :meth:`reset_energy_baseline` (``energy_baseline`` holds those
        energies); in ``calculate_batch``, the batch's first structure. The offsets
        cancel, so this is the energy spread to watch along a trajectory; it is 0
        on the baseline structure itself.
    ``forces_std``:
        ``(natoms, 3)``, the spread of each force component (``ddof=0``).
    ``max_force_dev``:
        ``max_i sqrt(mean_m |F_mi - F̄_i|²)``, in eV/Å: the largest spread of an
        atom's force vector, the usual active-learning criterion.
    ``stress_std``:
        ``(6,)``, the spread of each Voigt stress component (when stress was asked for).
    ``members``:
        ``{id: {"energy", "forces", "stress"}}``, each member's own values.
    ``dropped``:
        the ids of the members dropped (``on_member_error="drop"``), in order.
    """

    implemented_properties: tuple[str, ...] = ("energy", "free_energy", "forces", "stress")  # type: ignore[assignment]  # ASE annotates list[str]
    name = "rootstock-committee"

    def __init__(
        self,
        checkpoints: Sequence[str],
        device: str = "cuda",
        weights: Mapping[str, Any] | None = None,
        setup_kwargs: Mapping[str, dict[str, Any]] | None = None,
        reference: str | None = None,
        on_member_error: str = "raise",
        **member_options: Any,
    ) -> None:
        Calculator.__init__(self)
        ids = _checked_members(checkpoints)
        if reference is not None and reference not in ids:
            raise UsageError(
                f"reference {reference!r} is not a member of the committee ({', '.join(ids)})",
                hint="reference names one of the checkpoints, or None for the members' mean",
            )
        if on_member_error not in MEMBER_ERROR_MODES:
            raise UsageError(
                f"on_member_error must be 'raise' or 'drop', not {on_member_error!r}",
                hint="'drop' goes on without a failed member and names it in results['dropped']",
            )
        accepted = inspect.signature(RootstockCalculator).parameters
        unknown = sorted(k for k in member_options if k not in accepted or k in _PER_MEMBER)
        if unknown:
            raise UsageError(
                f"CommitteeCalculator got unknown keyword(s) {', '.join(unknown)}",
                hint="it takes checkpoints, device, weights and setup_kwargs (dicts keyed by "
                "member id), reference, on_member_error, and RootstockCalculator's keywords "
                "for every member: "
                + ", ".join(k for k in accepted if k not in (*_PER_MEMBER, "device")),
            )
        member_weights = _per_member("weights", weights, ids)
        member_setup = _per_member("setup_kwargs", setup_kwargs, ids)
        self.members: dict[str, RootstockCalculator] = {
            checkpoint: RootstockCalculator(
                checkpoint,
                device=device,
                weights=member_weights.get(checkpoint),
                setup_kwargs=member_setup.get(checkpoint),
                **member_options,
            )
            for checkpoint in ids
        }
        self.reference = reference
        self.on_member_error = on_member_error
        #: Members dropped after a failure (``on_member_error="drop"``), in order.
        self.dropped: list[str] = []
        #: Each dropped member's error.
        self.member_errors: dict[str, BaseException] = {}
        #: Each member's energy on the baseline structure of ``energy_std_relative``.
        self.energy_baseline: dict[str, float] = {}
        self.parameters.update(
            checkpoints=ids, device=device, reference=reference, on_member_error=on_member_error
        )
        self._setup()

    def _setup(self) -> None:
        self._call_lock = threading.RLock()
        self._stress_requested = False
        self._info_json = "{}"
        self._threads = _Threads(len(self.members))
        # Collection lets go of the members too; at exit their sessions stop the workers.
        self._finalizer = weakref.finalize(
            self, _close_all, list(self.members.values()), self._threads
        )
        self._finalizer.atexit = False

    # --- lifecycle -------------------------------------------------------------------

    @property
    def active(self) -> list[str]:
        """The members still in the committee (not dropped), in order."""
        return [m for m in self.members if m not in self.dropped]

    @property
    def worker_pids(self) -> dict[str, int | None]:
        """Each member's running worker process id (None: none running)."""
        return {m: calc.worker_pid for m, calc in self.members.items()}

    @property
    def provenance(self) -> dict[str, Any]:
        """Each member's :attr:`~rootstock.runtime.calculator.RootstockCalculator.provenance`."""
        return {m: calc.provenance for m, calc in self.members.items()}

    def reset_energy_baseline(self) -> None:
        """Make the next structure computed the baseline of ``energy_std_relative``."""
        self.energy_baseline = {}

    def close(self) -> None:
        """Let go of every member's worker (each stops unless another calculator
        shares it) and stop the thread pool. A closed committee can compute again."""
        with self._call_lock:
            _close_all(list(self.members.values()), self._threads)

    def __enter__(self) -> CommitteeCalculator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Members travel as their specs; the pool, lock and finalizer are remade."""
        state = self.__dict__.copy()
        for name in ("_call_lock", "_threads", "_finalizer"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    # --- running the members ---------------------------------------------------------

    def _on_members(
        self, work: Callable[[RootstockCalculator], _T]
    ) -> tuple[dict[str, _T], dict[str, BaseException]]:
        """``work(member)`` for every active member at once: all are submitted before
        any is awaited, and all have finished when this returns."""
        active = self.active
        if len(active) == 1:
            try:
                return {active[0]: work(self.members[active[0]])}, {}
            except Exception as exc:  # sorted out by settle_failures, as from the pool
                return {}, {active[0]: exc}
        pool = self._threads.get()
        futures = {m: pool.submit(work, self.members[m]) for m in active}
        concurrent.futures.wait(futures.values())
        done: dict[str, _T] = {}
        failed: dict[str, BaseException] = {}
        for member, future in futures.items():
            error = future.exception()
            if error is None:
                done[member] = future.result()
            else:
                failed[member] = error
        return done, failed

    def settle_failures(self, failed: dict[str, BaseException]) -> None:
        """Raise the first member failure (named), or drop the failed members
        (``on_member_error="drop"``) while at least one remains. For code that runs
        the members itself (``rootstock.evaluate`` on an executor)."""
        if not failed:
            return
        first, exc = next(iter(failed.items()))
        droppable = (
            self.on_member_error == "drop"
            and all(_droppable(e) for e in failed.values())
            and self.reference not in failed
            and len(self.active) > len(failed)
        )
        if not droppable:
            raise _name_member(exc, first)
        for member, error in failed.items():
            self.dropped.append(member)
            self.member_errors[member] = _name_member(error, member)

    # --- ASE interface ---------------------------------------------------------------

    def get_property(self, name: str, atoms: Any = None, allow_calculation: bool = True) -> Any:
        """ASE's get_property, one thread at a time (the results live on the calculator)."""
        with self._call_lock:
            return super().get_property(name, atoms, allow_calculation)

    def check_state(self, atoms: Any, tol: float = 1e-15) -> list[str]:
        """ASE's checks plus ``info``: a change of atoms.info alone recalculates, as
        for RootstockCalculator (the members forward it to their models)."""
        changes = list(super().check_state(atoms, tol))
        if not changes and self.atoms is not None and info_json(atoms.info) != self._info_json:
            changes.append("info")
        return changes

    def calculate(
        self,
        atoms: Any = None,
        properties: list[str] | tuple[str, ...] = ("energy",),
        system_changes: list[str] = all_changes,
    ) -> None:
        """Every active member on ``atoms`` at once; store the committee's results.

        Energy and forces are always computed; stress (3-D periodic cells) from the
        first time it is asked for onwards.
        """
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        periodic = is_3d_periodic(atoms)
        if "stress" in properties:
            if not periodic:
                raise PropertyNotImplementedError(
                    "stress is only computed for cells periodic in all three directions"
                )
            self._stress_requested = True
        stress: tuple[str, ...] = ("stress",) if periodic and self._stress_requested else ()
        names = (*stress, "energy", "free_energy", "forces")
        with self._call_lock:
            done, failed = self._on_members(lambda member: _member_single(member, atoms, names))
            self.settle_failures(failed)
            if not self.energy_baseline:
                self.energy_baseline = {m: float(r["energy"]) for m, r in done.items()}
            self.results = combine(done, self.reference, self.energy_baseline, self.dropped)
            self._info_json = info_json(atoms.info)

    # --- many structures -------------------------------------------------------------

    def iter_batch(
        self,
        images: Iterable[Any],
        properties: Iterable[str] = DEFAULT_PROPERTIES,
        batch_size: int | str | None = None,
        errors: str = "raise",
        max_memory: Any = None,
    ) -> Iterator[tuple[int, Outcome]]:
        """``(index, result)`` for every structure, in input order (see :meth:`calculate_batch`)."""
        lead = self.members[self.active[0]]
        # Checked (UsageError) before anything is sent; every member has the same options.
        plan = plan_batch(lead, images, properties, batch_size, errors, max_memory)
        return self._stream(plan)

    def _stream(self, plan: Any) -> Iterator[tuple[int, Outcome]]:
        baseline: dict[str, float] = {}

        def sizes() -> bool:
            return all(self.members[m].memory_report is not None for m in self.active)

        for chunk in plan.chunks(sizes):
            with self._call_lock:
                done, failed = self._on_members(
                    functools.partial(
                        _member_chunk, chunk=chunk, names=plan.properties, memory=plan.memory
                    )
                )
                self.settle_failures(failed)
            by_member = {m: dict(pairs) for m, pairs in done.items()}
            for index, _ in chunk:
                outcome = self.combine_outcomes(
                    {m: got[index] for m, got in by_member.items()}, baseline
                )
                if plan.raise_errors and isinstance(outcome, WorkerError):
                    raise outcome
                yield index, outcome

    def combine_outcomes(self, outcomes: dict[str, Outcome], baseline: dict[str, float]) -> Outcome:
        """One structure's committee result from its members' batch outcomes: the first
        member's WorkerError (named) if any failed, else the combined dict.
        ``baseline`` (each member's energy on the first structure) is filled from the
        first structure that every member computed, so pass the same dict in order."""
        for member, outcome in outcomes.items():
            if isinstance(outcome, WorkerError):
                return _name_member(outcome, member)  # type: ignore[return-value]  # a WorkerError stays one
        results: dict[str, dict[str, Any]] = {
            m: o for m, o in outcomes.items() if isinstance(o, dict)
        }
        if not baseline and all("energy" in r for r in results.values()):
            baseline.update({m: float(r["energy"]) for m, r in results.items()})
        return combine(results, self.reference, baseline, self.dropped)

    def calculate_batch(
        self,
        images: Iterable[Any],
        properties: Iterable[str] = DEFAULT_PROPERTIES,
        batch_size: int | str | None = None,
        errors: str = "raise",
        max_memory: Any = None,
    ) -> list[Outcome]:
        """Every structure through every member, the same chunks sent to all at once.

        ``results[i]`` carries the keys ``calc.results`` has after a single call
        (spreads, ``members`` and ``dropped`` included), for the properties asked
        for; ``energy_std_relative`` is relative to the batch's first structure
        (the first whose result is not an error). A structure that fails in any
        member is that member's ``WorkerError`` (message starting with ``committee
        member 'ID':``): raised with ``errors="raise"``, in its slot with
        ``"return"``. A member whose worker dies or times out is handled by
        ``on_member_error``; a ``WorkerDiedError`` raised here carries
        ``partial_results``. ``calc.results`` is left alone.
        """
        results: list[Outcome] = []
        try:
            for _, outcome in self.iter_batch(images, properties, batch_size, errors, max_memory):
                results.append(outcome)
        except WorkerDiedError as exc:
            exc.partial_results = results
            raise
        return results
