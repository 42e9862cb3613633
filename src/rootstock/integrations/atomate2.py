"""atomate2 force-field makers that run a Rootstock checkpoint (``rootstock[atomate2]``).

``RootstockStaticMaker``, ``RootstockRelaxMaker`` and ``RootstockMDMaker`` are
atomate2's force-field makers with the calculator swapped for a
:class:`~rootstock.RootstockCalculator`. atomate2 caches the calculator on the maker
and never closes it, so each job closes it when it ends (the worker stops) unless
``keep_worker=True``. The task document's ``forcefield_name`` reads
``rootstock:<checkpoint>`` and ``forcefield_version`` rootstock's version, and
its ``entry.parameters["provenance"]`` (pymatgen's place for how an entry was
computed) holds the calculator's provenance. See docs/integrations.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rootstock.parallel import require_extra

require_extra("atomate2", ("atomate2", "jobflow"))

if TYPE_CHECKING:
    from collections.abc import Callable

    from rootstock.runtime import RootstockCalculator

# Imported by name so that mypy, in an env without atomate2, sees them as Any.
_jobs: Any = importlib.import_module("atomate2.forcefields.jobs")
_md: Any = importlib.import_module("atomate2.forcefields.md")
_job: Any = importlib.import_module("jobflow").job

__all__ = ["RootstockMDMaker", "RootstockRelaxMaker", "RootstockStaticMaker"]

# What atomate2 loads to name the calculator class and find the package version.
_CALCULATOR_META = {"@module": "rootstock", "@callable": "RootstockCalculator"}


@dataclass(kw_only=True)
class _RootstockMaker:
    """The fields and calculator handling the three makers share."""

    checkpoint: str
    root: str | None = None
    cluster: str | None = None
    device: str = "cpu"
    setup_kwargs: dict[str, Any] = field(default_factory=dict)
    keep_worker: bool = False

    def __post_init__(self) -> None:
        # Set before atomate2's __post_init__ turns it into calculator_meta.
        self.force_field_name = dict(_CALCULATOR_META)
        super().__post_init__()  # type: ignore[misc]  # atomate2's makers define it

    @property
    def ase_calculator_name(self) -> str:
        """The name atomate2 writes as the task document's ``forcefield_name``."""
        return f"rootstock:{self.checkpoint}"

    def _get_calculator(self) -> RootstockCalculator:
        """A RootstockCalculator for this maker's checkpoint (atomate2 caches it)."""
        from rootstock.runtime import RootstockCalculator

        kwargs: dict[str, Any] = dict(getattr(self, "calculator_kwargs", {}) or {})
        kwargs.update(
            checkpoint=self.checkpoint,
            root=self.root,
            cluster=self.cluster,
            device=self.device,
            setup_kwargs=self.setup_kwargs or None,
        )
        return RootstockCalculator(**kwargs)

    def _run_ase_safe(self, *args: Any, **kwargs: Any) -> Any:
        """atomate2's run_ase, without its torch default-dtype guard.

        The model runs in the worker's process; atomate2's guard imports torch, which
        the client's Python need not have.
        """
        return self.run_ase(*args, **kwargs)  # type: ignore[attr-defined]  # atomate2's makers define it

    def _run_then_close(self, make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run atomate2's own job body, recording the provenance in its task document(s);
        close the worker after unless keep_worker."""
        try:
            output = make(self, *args, **kwargs)
            calculator = getattr(self, "_calculator", None)
            if calculator is not None:
                _record_provenance(output, calculator.provenance)
            return output
        finally:
            calculator = getattr(self, "_calculator", None)
            if calculator is not None and not self.keep_worker:
                calculator.close()
                # A later job on this maker starts a fresh worker.
                self._calculator = None


def _record_provenance(output: Any, provenance: Any) -> None:
    """Put ``provenance`` into the entry parameters of the task document (or of each,
    for a list of structures): the task document has no field of its own for it."""
    for document in output if isinstance(output, list) else [output]:
        entry = getattr(document, "entry", None)
        if entry is not None:
            entry.parameters["provenance"] = provenance


def _original(method: Any) -> Callable[..., Any]:
    """The function under jobflow's ``@job`` decorator."""
    return getattr(method, "original", method)


@dataclass(kw_only=True)
class RootstockRelaxMaker(_RootstockMaker, _jobs.ForceFieldRelaxMaker):
    """atomate2's ForceFieldRelaxMaker on a Rootstock checkpoint."""

    name: str = "Rootstock relax"

    @_job(data=_jobs._FORCEFIELD_DATA_OBJECTS)
    def make(self, structure: Any, prev_dir: Any = None) -> Any:
        """Relax ``structure`` (a pymatgen Structure or Molecule, or a list)."""
        return self._run_then_close(
            _original(_jobs.ForceFieldRelaxMaker.make), structure, prev_dir=prev_dir
        )


@dataclass(kw_only=True)
class RootstockStaticMaker(_RootstockMaker, _jobs.ForceFieldStaticMaker):
    """atomate2's ForceFieldStaticMaker on a Rootstock checkpoint."""

    name: str = "Rootstock static"

    @_job(data=_jobs._FORCEFIELD_DATA_OBJECTS)
    def make(self, structure: Any, prev_dir: Any = None) -> Any:
        """Energy, forces and stress of ``structure`` (or of each in a list)."""
        return self._run_then_close(
            _original(_jobs.ForceFieldStaticMaker.make), structure, prev_dir=prev_dir
        )


@dataclass(kw_only=True)
class RootstockMDMaker(_RootstockMaker, _md.ForceFieldMDMaker):
    """atomate2's ForceFieldMDMaker on a Rootstock checkpoint."""

    name: str = "Rootstock MD"

    @_job(data=[*_jobs._FORCEFIELD_DATA_OBJECTS, "ionic_steps"])
    def make(self, structure: Any, prev_dir: Any = None) -> Any:
        """Molecular dynamics from ``structure``."""
        return self._run_then_close(
            _original(_md.ForceFieldMDMaker.make), structure, prev_dir=prev_dir
        )
