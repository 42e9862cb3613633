"""``rootstock benchmark --system`` and ``--setup-kwargs``: what the command line means.

``El:N`` is element El's ASE reference crystal (``ase.data.reference_states``) at its
reference lattice constant, when that crystal is cubic (fcc, bcc, sc, diamond),
repeated n x n x n for the smallest n that gives at least N atoms. Anything else is
an ASE molecule name. Everything that is neither is a usage error naming the forms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rootstock.errors import UsageError
from rootstock.install.parsing import MAX_KWARG_DEPTH, ParseProblem, loads_json

MAX_ATOMS = 1_000_000
MOLECULE_VACUUM = 10.0  # Å around a molecule, for models that need a cell

# ASE reference states that are cubic, and the atoms in their conventional cell.
CUBIC_ATOMS_PER_CELL = {"fcc": 4, "bcc": 2, "sc": 1, "diamond": 8}
SYSTEM_FORMS = (
    "El:N (a cubic crystal of element El with at least N atoms: Cu:256, Si:64, Fe:128) "
    "or an ASE molecule name (H2O, CH4, C6H6; see ase.collections.g2)"
)
_BULK_RE = re.compile(r"^(?P<element>[A-Za-z]{1,3}):(?P<count>.*)$")


@dataclass(frozen=True)
class BenchmarkSystem:
    """The structure every call of the walk starts from, and how it was made."""

    spec: str
    kind: str  # "bulk" or "molecule"
    atoms: Any
    structure: str | None = None
    lattice_constant: float | None = None
    repeat: int | None = None

    @property
    def natoms(self) -> int:
        return len(self.atoms)

    @property
    def periodic(self) -> bool:
        return bool(self.atoms.pbc.all())

    def to_dict(self) -> dict[str, Any]:
        """The ``system`` object of ``--json``."""
        return {
            "spec": self.spec,
            "kind": self.kind,
            "formula": self.atoms.get_chemical_formula(),
            "natoms": self.natoms,
            "periodic": self.periodic,
            "structure": self.structure,
            "lattice_constant": self.lattice_constant,
            "repeat": self.repeat,
        }


def smallest_cubic_repeat(atoms_per_cell: int, at_least: int) -> int:
    """The smallest n with ``atoms_per_cell * n**3 >= at_least``."""
    if atoms_per_cell < 1 or at_least < 1:
        raise ValueError("atoms_per_cell and at_least must be positive")
    n = max(1, round((at_least / atoms_per_cell) ** (1 / 3)))
    while atoms_per_cell * n**3 < at_least:
        n += 1
    while n > 1 and atoms_per_cell * (n - 1) ** 3 >= at_least:
        n -= 1
    return n


def _bad_system(text: str, why: str) -> UsageError:
    return UsageError(f"--system {text!r}: {why}", hint=f"pass {SYSTEM_FORMS}")


def bulk_system(text: str, element: str, count_text: str) -> BenchmarkSystem:
    """``El:N``: El's ASE reference crystal (cubic only), repeated to >= N atoms."""
    from ase.build import bulk
    from ase.data import atomic_numbers, reference_states

    try:
        count = int(count_text)
    except ValueError:
        raise _bad_system(text, f"{count_text!r} is not a whole number of atoms") from None
    if count < 1 or count > MAX_ATOMS:
        raise _bad_system(text, f"the atom count must be 1 to {MAX_ATOMS:,}")
    number = atomic_numbers.get(element)
    if number is None:
        why = f"{element!r} is not a chemical element"
        if element.capitalize() in atomic_numbers:
            why += f" (symbols are case-sensitive: {element.capitalize()})"
        raise _bad_system(text, why)
    state = reference_states[number] or {}
    structure = state.get("symmetry")
    if structure not in CUBIC_ATOMS_PER_CELL:
        cubic = sorted(
            sym
            for sym, z in atomic_numbers.items()
            if (reference_states[z] or {}).get("symmetry") in CUBIC_ATOMS_PER_CELL
        )
        raise _bad_system(
            text,
            f"{element}'s ASE reference state is {structure or 'not defined'}, not cubic; "
            f"El:N takes an element whose reference crystal is fcc, bcc, sc or diamond "
            f"({', '.join(cubic[:12])}, ...), or pass a molecule name",
        )
    lattice = state.get("a")
    if not isinstance(lattice, int | float):  # ASE gives every cubic state one; a guard
        raise _bad_system(text, f"ASE's reference state of {element} has no lattice constant")
    a = float(lattice)
    n = smallest_cubic_repeat(CUBIC_ATOMS_PER_CELL[structure], count)
    atoms = bulk(element, structure, a=a, cubic=True) * (n, n, n)
    return BenchmarkSystem(text, "bulk", atoms, structure, a, n)


def molecule_system(text: str) -> BenchmarkSystem:
    """An ASE molecule by name, centred in a box of vacuum, not periodic."""
    from ase.build import molecule

    try:
        atoms = molecule(text)
    except (KeyError, ValueError):
        raise _bad_system(text, "not El:N and not an ASE molecule name") from None
    atoms.center(vacuum=MOLECULE_VACUUM)
    atoms.pbc = False
    return BenchmarkSystem(text, "molecule", atoms)


def parse_system(text: str) -> BenchmarkSystem:
    """``--system``: ``El:N`` or an ASE molecule name; a usage error for anything else."""
    text = (text or "").strip()
    if not text:
        raise _bad_system(text, "empty")
    match = _BULK_RE.match(text)
    if match:
        return bulk_system(text, match["element"], match["count"])
    if ":" in text:
        raise _bad_system(text, "not of the form El:N")
    return molecule_system(text)


def parse_setup_kwargs(text: str | None) -> dict[str, Any] | None:
    """``--setup-kwargs JSON``: a JSON object, or None when not given."""
    if text is None:
        return None
    try:
        value = loads_json(text, max_depth=MAX_KWARG_DEPTH)
    except ParseProblem as exc:
        raise UsageError(
            f"--setup-kwargs is not valid JSON ({exc})",
            hint='pass a JSON object, e.g. --setup-kwargs \'{"task": "omat"}\'',
        ) from None
    if not isinstance(value, dict):
        raise UsageError(
            f"--setup-kwargs must be a JSON object, not {type(value).__name__}",
            hint='pass a JSON object, e.g. --setup-kwargs \'{"task": "omat"}\'',
        )
    return value
