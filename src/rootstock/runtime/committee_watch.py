"""Uncertainty-aware runs: stop, or keep the structure, when a committee disagrees.

``dyn.attach(watch(calc, max_force_dev=0.2))`` checks the committee's spreads after
every step of an ASE dynamics or optimiser run (docs/committee.md).
"""

from __future__ import annotations

import os
from typing import Any

from rootstock.errors import RootstockError, UsageError

#: The spreads a watch can bound, and their units.
WATCHED = {"max_force_dev": "eV/Å", "energy_std": "eV", "energy_std_relative": "eV"}


class UncertaintyExceeded(RootstockError):
    """A committee's spread crossed a threshold of :func:`watch`.

    ``atoms`` is a copy of the structure (with the committee's energy, forces and
    stress attached as a single-point calculator), ``spreads`` the committee's
    ``max_force_dev``, ``energy_std`` and ``energy_std_relative`` for it, and
    ``exceeded`` the names of the spreads above their thresholds.
    """

    def __init__(
        self, message: str, atoms: Any = None, spreads: dict[str, float] | None = None,
        exceeded: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        super().__init__(
            message,
            hint="run the structure with a reference method, or pass trajectory= to "
            "watch() to keep such structures and go on",
        )
        self.atoms = atoms
        self.spreads = dict(spreads or {})
        self.exceeded = exceeded


def _frame(calc: Any) -> Any:
    """A copy of the committee's last structure, carrying its results and spreads."""
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms = calc.atoms.copy()
    results = {k: calc.results[k] for k in ("energy", "forces", "stress") if k in calc.results}
    atoms.calc = SinglePointCalculator(atoms, **results)
    atoms.info["committee"] = {
        k: calc.results[k] for k in WATCHED if k in calc.results
    }  # ase's trajectories keep JSON-able info
    return atoms


class CommitteeWatch:
    """The callable :func:`watch` returns; ``frames`` counts the structures written."""

    def __init__(self, calc: Any, thresholds: dict[str, float], trajectory: Any) -> None:
        self.calc = calc
        self.thresholds = thresholds
        self.trajectory = trajectory
        self.frames = 0

    def __call__(self) -> None:
        """Check the committee's last result; raise or write when a spread is too large."""
        results = self.calc.results
        spreads = {k: float(results[k]) for k in WATCHED if k in results}
        exceeded = tuple(k for k, limit in self.thresholds.items() if spreads.get(k, 0.0) > limit)
        if not exceeded or self.calc.atoms is None:
            return
        frame = _frame(self.calc)
        if self.trajectory is None:
            what = ", ".join(
                f"{k} {spreads[k]:.4g} {WATCHED[k]} > {self.thresholds[k]:g}" for k in exceeded
            )
            raise UncertaintyExceeded(
                f"the committee disagrees: {what}", atoms=frame, spreads=spreads,
                exceeded=exceeded,
            )  # fmt: skip
        self._write(frame)

    def _write(self, frame: Any) -> None:
        if isinstance(self.trajectory, str | os.PathLike):
            from ase.io.trajectory import Trajectory

            with Trajectory(self.trajectory, "a") as traj:
                traj.write(frame)
        else:
            self.trajectory.write(frame)
        self.frames += 1


def watch(
    calc: Any,
    max_force_dev: float | None = 0.2,
    energy_std: float | None = None,
    trajectory: Any = None,
    energy_std_relative: float | None = None,
) -> CommitteeWatch:
    """A callable for ``dyn.attach(...)`` that watches a CommitteeCalculator's spread.

    After each step it reads ``calc.results``; when ``max_force_dev`` (eV/Å),
    ``energy_std`` or ``energy_std_relative`` (eV) is above its threshold (None:
    not watched) it raises :class:`UncertaintyExceeded`, carrying a copy of the
    structure and the spreads. With ``trajectory=`` (a path, appended to, or an
    open ``ase.io.Trajectory``) it writes the structure there instead, with the
    committee's energy, forces and stress and ``atoms.info["committee"]`` holding
    the spreads, and the run goes on. ``energy_std`` includes the members' offsets
    of the zero of energy; ``energy_std_relative`` does not (see CommitteeCalculator).
    """
    thresholds = {
        name: value
        for name, value in (
            ("max_force_dev", max_force_dev),
            ("energy_std", energy_std),
            ("energy_std_relative", energy_std_relative),
        )
        if value is not None
    }
    for name, value in thresholds.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise UsageError(f"{name} must be a non-negative number or None, not {value!r}")
    if not thresholds:
        raise UsageError(
            "watch() needs at least one threshold",
            hint="e.g. watch(calc, max_force_dev=0.2) or watch(calc, energy_std_relative=0.05)",
        )
    if not hasattr(calc, "results") or not hasattr(calc, "members"):
        raise UsageError(
            f"watch() takes a CommitteeCalculator, not {type(calc).__name__}",
            hint="CommitteeCalculator([...]) reports the spreads that watch() checks",
        )
    if (
        trajectory is not None
        and not isinstance(trajectory, str | os.PathLike)
        and not callable(getattr(trajectory, "write", None))
    ):
        raise UsageError(
            f"trajectory must be a path or an open ase Trajectory, not {type(trajectory).__name__}"
        )
    return CommitteeWatch(calc, thresholds, trajectory)
