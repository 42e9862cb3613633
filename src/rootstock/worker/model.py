"""Loading the env's ``setup()`` and running the model on one structure.

``env_source.py`` is compiled from source at every spawn (never from a cached
``.pyc``), so an in-place hotfix takes effect at the next spawn even when the
edit kept the file's size and modification second.

Besides energy, forces and the virial, a calculation reports (in the FORCEREADY
extra JSON, rootstock clients only) the model's dtype and the ASE extras it fills
(``magmoms``, ``charges``, ``energies``, ``dipole``), and the values of the extras
the client asked for; see docs/protocol.md.

Every result is checked before it is encoded: a property of the wrong type or
shape would otherwise be written with the wrong length and put the stream out of
step (forces of shape (n, 4)) or leave the client waiting for bytes that never
come (n, 2). A bad result raises :class:`MalformedResult`, which the loop reports
like any model error; NaN or inf raises :class:`NonFiniteResult` unless the client
allowed them.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from rootstock.wire.framing import EXTRA_PROPERTIES, extra_array
from rootstock.worker.device import detect_model_device
from rootstock.worker.dtype import detect_model_dtype
from rootstock.worker.memory import ChunkSizer

log = logging.getLogger("rootstock.worker")

ENV_MODULE_NAME = "rootstock_env_source"
ARRAYS_FORWARDED = ("initial_magmoms", "initial_charges")


class WeightsNotLoaded(Exception):
    """``setup_from_path()`` raised on the user's weights; the message names the path."""


class MalformedResult(ValueError):
    """The model returned a property of the wrong type or shape; the message names both."""


class NonFiniteResult(MalformedResult):
    """The model returned NaN or inf in its energy, forces or stress."""


def _real_array(name: str, value: Any) -> np.ndarray:
    """``value`` as a float64 array, or MalformedResult when it is not real numbers."""
    if isinstance(value, str | bytes):
        raise MalformedResult(f"the model's {name} is a string ({value[:40]!r}), not numbers")
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()  # a torch tensor, possibly on an accelerator
    try:
        array = np.asarray(value)
    except Exception as exc:  # whatever a foreign __array__ raises; the message says which
        raise MalformedResult(
            f"the model's {name} ({type(value).__name__}) cannot be read as numbers: {exc}"
        ) from None
    if array.dtype.kind not in "iuf":
        what = type(value).__name__ if array.ndim == 0 else f"an array of {array.dtype}"
        raise MalformedResult(
            f"the model's {name} is {what} with shape {array.shape}, not real numbers"
        )
    return array.astype(np.float64, copy=False)


def checked_energy(name: str, value: Any) -> float:
    """An energy (or free energy) as a float: one real number, any array rank."""
    array = _real_array(name, value)
    if array.size != 1:
        raise MalformedResult(
            f"the model's {name} has shape {array.shape}, expected a single number"
        )
    return float(array.reshape(()))


def checked_forces(value: Any, natoms: int) -> np.ndarray:
    """Forces as a float64 array of shape (natoms, 3)."""
    array = _real_array("forces", value)
    if array.shape != (natoms, 3):
        raise MalformedResult(
            f"the model's forces have shape {array.shape}, expected ({natoms}, 3) "
            f"for {natoms} atoms"
        )
    return array


def checked_stress(value: Any) -> np.ndarray:
    """A stress as a 3x3 float64 array: Voigt (6,) or already 3x3 (as matgl returns)."""
    from ase.stress import voigt_6_to_full_3x3_stress

    array = _real_array("stress", value)
    if array.shape == (6,):
        return voigt_6_to_full_3x3_stress(array)
    if array.shape == (3, 3):
        return array
    raise MalformedResult(
        f"the model's stress has shape {array.shape}, expected (6,) (Voigt order) or (3, 3)"
    )


def check_finite(name: str, value: float | np.ndarray) -> None:
    """Raise NonFiniteResult naming the first NaN or inf in ``value``."""
    array = np.asarray(value)
    finite = np.isfinite(array)
    if finite.all():
        return
    if array.ndim == 0:
        raise NonFiniteResult(f"the model's {name} is {float(array)}")
    first = tuple(int(i) for i in np.unravel_index(int(np.argmin(finite)), array.shape))
    where = ", ".join(map(str, first))
    raise NonFiniteResult(
        f"the model's {name} has {int(array.size - finite.sum())} non-finite value(s) "
        f"of {array.size} (shape {array.shape}); {name}[{where}] is {float(array[first])}"
    )


@dataclass
class Evaluation:
    """One structure's checked results: eV, eV/Å and an eV virial (None: no stress).

    ``free_energy`` is set only when it differs from the energy; ``extras`` holds
    the values of the extras asked for, ``filled`` every extra the model filled.
    """

    energy: float
    forces: np.ndarray
    virial: np.ndarray | None
    free_energy: float | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    filled: frozenset[str] = frozenset()


class _FreshSourceLoader(importlib.machinery.SourceFileLoader):
    """A source loader that neither reads nor writes bytecode for the env file."""

    def get_code(self, fullname: str) -> Any:
        source = self.get_data(self.path)
        return self.source_to_code(source, self.path)


def load_env_source(path: str | Path) -> ModuleType:
    """Import ``env_source.py`` by path, afresh."""
    path = str(Path(path).absolute())
    loader = _FreshSourceLoader(ENV_MODULE_NAME, path)
    spec = importlib.util.spec_from_file_location(ENV_MODULE_NAME, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import the env source {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered first so that dataclasses and pickling inside the env file work.
    sys.modules[ENV_MODULE_NAME] = module
    loader.exec_module(module)
    return module


def make_calculator(
    module: ModuleType,
    checkpoint: str,
    device: str,
    kwargs: dict[str, Any],
    weights: str | None = None,
) -> Any:
    """Call ``setup()`` (or ``setup_from_path()`` for user weights); return its calculator."""
    if weights is not None:
        hook = getattr(module, "setup_from_path", None)
        if hook is None:
            raise AttributeError(
                f"{module.__file__} has no setup_from_path(path, device, **kw), "
                f"so it cannot load user weights for {checkpoint!r}"
            )
        try:
            calc = hook(weights, device=device, **kwargs)
        except Exception as exc:
            kind = "directory" if Path(weights).is_dir() else "file"
            # Chained, so the worker's traceback still shows where the family failed.
            raise WeightsNotLoaded(
                f"could not load the weights {kind} {weights} for {checkpoint!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    else:
        calc = module.setup(checkpoint, device=device, **kwargs)
    if calc is None or not hasattr(calc, "get_potential_energy"):
        raise TypeError(f"setup() for {checkpoint!r} returned {calc!r}, not an ASE calculator")
    return calc


def _is_plain_ase_calculator(calc: Any) -> bool:
    """True for an ase Calculator that keeps ASE's own property plumbing."""
    from ase.calculators.calculator import BaseCalculator, Calculator

    if not isinstance(calc, Calculator):
        return False
    cls = type(calc)
    return all(
        getattr(cls, name) is getattr(BaseCalculator, name)
        for name in ("get_property", "get_potential_energy", "get_forces", "get_stress")
    )


class ModelRunner:
    """Holds the model calculator and the current system (species, PBC, info)."""

    def __init__(
        self, calc: Any, model_dtype: str | None = None, model_device: str | None = None
    ) -> None:
        self.calc = calc
        self.atoms: Any = None
        self.want_stress = False
        self.lenient_stress = False
        # NaN or inf in energy, forces or stress is an error unless the client says so.
        self.allow_nonfinite = False
        self._direct = _is_plain_ase_calculator(calc)
        self._fresh = True
        self._last_cell: bytes | None = None
        self.model_dtype = detect_model_dtype(calc) if model_dtype is None else model_dtype
        self.model_device = detect_model_device(calc) if model_device is None else model_device
        # Rootstock clients (a JSON INIT) get the model report and extras; standard
        # i-PI servers get the bare frames.
        self.dialect = False
        self.extras_wanted: tuple[str, ...] = ()
        advertised = getattr(calc, "implemented_properties", ()) or ()
        self._advertised = tuple(n for n in EXTRA_PROPERTIES if n in advertised)
        # Until the first calculation succeeds, ask for every advertised extra once,
        # so that a model filling one only on request shows it in its results.
        self._probe = self._advertised
        self._reported: frozenset[str] | None = None
        # Whether the next reply carries the model report (after every INIT).
        self.report_due = True
        self._sibling: ModelRunner | None = None
        # The env has an evaluate_batch hook and this worker takes RSMERGE: the model
        # report says so, which is how the pool daemon learns it may merge calls.
        self.merge_ready = False

    @property
    def ready(self) -> bool:
        return self.atoms is not None

    def configure(self, config: dict[str, Any]) -> None:
        """Apply a rootstock INIT config: a new system, so stale results are dropped."""
        from ase import Atoms

        self.atoms = None
        atoms = Atoms(numbers=config["numbers"], pbc=config["pbc"])
        info = config.get("info") or {}
        if not isinstance(info, dict):
            raise TypeError("INIT info must be a JSON object")
        atoms.info.update(info)
        for name, values in (config.get("arrays") or {}).items():
            if name in ARRAYS_FORWARDED:
                atoms.set_array(name, np.asarray(values, dtype=np.float64))
        self._attach(atoms)
        self.want_stress = bool(config.get("stress"))
        self.lenient_stress = False
        self.allow_nonfinite = config.get("allow_nonfinite") is True
        self.dialect = True
        self.report_due = True
        wanted = config.get("extras") or []
        if not isinstance(wanted, list):
            raise TypeError("INIT extras must be a JSON list of property names")
        self.extras_wanted = tuple(n for n in EXTRA_PROPERTIES if n in wanted)

    def use_template(self, template: Any) -> None:
        """Standard i-PI mode: the species and PBC come from a structure file."""
        from ase import Atoms

        atoms = Atoms(numbers=template.numbers, pbc=template.pbc, cell=template.cell)
        atoms.info.update(template.info)
        for name in ARRAYS_FORWARDED:
            if name in template.arrays:
                atoms.set_array(name, template.arrays[name].copy())
        self._attach(atoms)
        self.want_stress = bool(atoms.pbc.all())
        # i-PI only needs forces; a model without stress must still run MD.
        self.lenient_stress = True

    def start_system(self, atoms: Any, want_stress: bool) -> None:
        """Take ``atoms`` (a batch's structure) as the system; the model starts clean."""
        self._attach(atoms)
        self.want_stress = want_stress

    def _attach(self, atoms: Any) -> None:
        # Calculators do not compare atoms.info, so a charge change alone would hit
        # their cache: start from a clean slate on every new system.
        reset = getattr(self.calc, "reset", None)
        if reset is not None:
            reset()
        atoms.calc = self.calc
        self.atoms = atoms
        self._fresh = True

    def compute(
        self, cell: np.ndarray, positions: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray, bytes]:
        """Energy (eV), forces (eV/Å), virial (eV) and the extra bytes for one geometry.

        Raises MalformedResult (NonFiniteResult) when the model's results cannot be
        sent as they are.
        """
        result = self.evaluate(cell, positions)
        virial = np.zeros((3, 3)) if result.virial is None else result.virial
        return result.energy, result.forces, virial, self.extra_bytes(result)

    def evaluate(self, cell: np.ndarray, positions: np.ndarray) -> Evaluation:
        """The checked results for one geometry of the current system (see :meth:`compute`)."""
        atoms = self.atoms
        if atoms is None:
            raise RuntimeError(
                "the worker does not know the species: a standard i-PI server sends "
                "none, so start it with `rootstock serve ... --structure FILE`"
            )
        if len(positions) != len(atoms):
            raise ValueError(
                f"the server sent {len(positions)} atoms, but the structure has {len(atoms)}"
            )
        changes = self._changes(cell)
        atoms.cell[:] = cell
        atoms.positions[:] = positions
        a, b, c = atoms.cell.array
        stress_wanted = self.want_stress and bool(a.any() and b.any() and c.any())
        results = self._direct_results(changes, stress_wanted) if self._direct else None
        if results is None:
            energy = atoms.get_potential_energy()
            forces = atoms.get_forces()
            stress = self._public_stress() if stress_wanted else None
        else:
            energy, forces, stress = results
        natoms = len(atoms)
        energy = checked_energy("energy", energy)
        forces = checked_forces(forces, natoms)
        virial = None
        if stress is not None:
            stress = checked_stress(stress)
            virial = -atoms.get_volume() * stress
        if not self.allow_nonfinite:
            check_finite("energy", energy)
            check_finite("forces", forces)
            if stress is not None:
                check_finite("stress", stress)
        return self._with_extras(Evaluation(energy, forces, virial), natoms)

    def _with_extras(self, result: Evaluation, natoms: int) -> Evaluation:
        """Add the free energy, the extras the model filled and those asked for."""
        results = getattr(self.calc, "results", None) or {}
        free = results.get("free_energy")
        if free is not None:
            free = checked_energy("free_energy", free)
            if not self.allow_nonfinite:
                check_finite("free_energy", free)
            if free != result.energy:
                result.free_energy = free
        self._probe = ()
        if self.dialect:
            result.filled = frozenset(n for n in EXTRA_PROPERTIES if results.get(n) is not None)
            for name in self.extras_wanted:
                value = results.get(name)
                if value is None and name in self._advertised and not self._direct:
                    value = self._public_extra(name)
                if value is not None:
                    try:
                        result.extras[name] = extra_array(name, value, natoms)
                    except ValueError as exc:
                        raise MalformedResult(str(exc)) from None
        return result

    def model_report(self, filled: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The ``model`` report: the dtype, the device (when known) and every extra seen
        filled so far (plus ``filled``)."""
        self._reported = filled | (self._reported or frozenset())
        self.report_due = False
        report: dict[str, Any] = {"dtype": self.model_dtype, "extras": sorted(self._reported)}
        if self.model_device is not None:
            report["device"] = self.model_device
        if self.merge_ready:
            report["merge"] = True
        return report

    def extra_bytes(self, result: Evaluation) -> bytes:
        """The FORCEREADY extra bytes: empty unless there is something to say."""
        doc: dict[str, Any] = {}
        if result.free_energy is not None:
            doc["free_energy"] = result.free_energy
        if self.dialect:
            filled = result.filled
            # Told after every INIT (a shared worker's next client has not heard it),
            # and again whenever the model fills a new extra.
            if self.report_due or self._reported is None or not filled <= self._reported:
                doc["model"] = self.model_report(filled)
            for name, value in result.extras.items():
                doc[name] = value.tolist()
        if not doc:
            return b""
        return json.dumps(doc).encode("ascii")

    @functools.cached_property
    def chunk_sizer(self) -> ChunkSizer:
        """The sizer of this worker's memory-bounded batches (:mod:`rootstock.worker.memory`),
        made on first use: what it learns of the model is kept for the worker's life."""
        return ChunkSizer(self.model_device)

    def batch_sibling(self) -> ModelRunner:
        """A runner on the same model calculator for the structures of a batch.

        It keeps its own system, so the single-call system of this runner (the last
        INIT) survives the batch; made once and reused.
        """
        sibling = self._sibling
        if sibling is None:
            sibling = self._sibling = ModelRunner(
                self.calc, model_dtype=self.model_dtype, model_device=self.model_device
            )
        sibling.dialect = True
        sibling._probe = ()
        return sibling

    def after_batch(self) -> None:
        """Make this runner's next calculation start clean after a batch used its model.

        The model calculator last saw a batch structure, which may equal this
        runner's geometry in everything ASE compares but ``info``.
        """
        reset = getattr(self.calc, "reset", None)
        if reset is not None:
            reset()
        if self.atoms is not None:
            self.atoms.calc = self.calc
        self._fresh = True

    def _public_extra(self, name: str) -> Any:
        """An extra that a calculator with its own plumbing computes only on request."""
        from ase.calculators.calculator import PropertyNotImplementedError

        try:
            return self.calc.get_property(name, self.atoms)
        except PropertyNotImplementedError:
            return None

    def _changes(self, cell: np.ndarray) -> list[str]:
        from ase.calculators.calculator import all_changes

        key = np.asarray(cell, dtype=np.float64).tobytes()
        if self._fresh or self._last_cell is None:
            self._fresh = False
            changes = list(all_changes)
        elif key == self._last_cell:
            changes = ["positions"]
        else:
            changes = ["positions", "cell"]
        self._last_cell = key
        return changes

    def _direct_results(self, changes: list[str], stress_wanted: bool) -> tuple | None:
        """One ``calculate()`` for all properties, as ASE's get_property would call it.

        The client sends a geometry only when something changed, and the worker
        knows what (INIT: everything; else positions, and the cell if it moved).
        So the per-property ``check_state`` comparisons, which cost more than the
        whole round trip for a fast model, are skipped. Calculators that replace
        ASE's property plumbing take the public path instead.
        """
        calc = self.calc
        properties = ["energy", "forces"]
        if stress_wanted:
            if "stress" not in calc.implemented_properties:
                return None
            properties.append("stress")
        required = len(properties)
        if self.extras_wanted or (self._probe and self.dialect):
            asked = set(self.extras_wanted) | set(self._probe)
            properties.extend(n for n in self._advertised if n in asked)
        calc.atoms = None
        calc.results = {}
        calc.calculate(self.atoms, properties, changes)
        results = calc.results
        if not all(name in results for name in properties[:required]):
            return None  # the public path fills in what this calculator left out
        stress = results["stress"] if stress_wanted else None
        return results["energy"], results["forces"], stress

    def _public_stress(self) -> Any:
        """The model's stress as it returns it (checked by the caller), or None.

        Taken from the calculator rather than ``atoms.get_stress()``, whose shape
        check is an ``assert``; the worker's atoms carry no constraints to apply.
        """
        from ase.calculators.calculator import PropertyNotImplementedError

        try:
            return self.calc.get_stress(self.atoms)
        except PropertyNotImplementedError:
            if not self.lenient_stress:
                raise
            log.warning("the model computes no stress; sending a zero virial")
            self.want_stress = False
            return None
