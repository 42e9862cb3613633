"""Physics checks for verification: forces and stress against the energy.

A forward pass that returns finite numbers can still be wrong by a unit or a
sign. For a conservative model, forces are the negative gradient of the energy
and the stress is its strain derivative divided by the volume, so both can be
checked with a few extra energy calls by central finite differences:

* **forces**: along random unit displacement directions ``u`` of all atoms,
  ``-F·u`` against ``(E(x + h u) - E(x - h u)) / 2h``;
* **stress**: along random symmetric unit strains ``ε``, ``V σ:ε`` against
  ``(E((I + h ε)) - E((I - h ε))) / 2h``, for 3-D periodic structures only
  (``n/a`` otherwise).

Each check is reported as a *ratio*, model over finite difference
(``⟨a, b⟩ / ⟨b, b⟩`` over the directions): 1.0 is perfect, -1 is a sign error,
160.2 is GPa reported as eV/Å³. A *gradient* quantity passes when the ratio is
within 2 % of 1 in float64, 10 % in float32. A *direct* quantity (predicted, not
differentiated, as ORB "direct" does) and any quantity of a model whose energy is
declared *non-smooth* on the reference get a loose bound that still catches
units and signs: a cosine of at least 0.9 with the finite difference, and a norm
ratio within [0.5, 2].

A non-smooth energy (a neighbour cap that keeps only the k nearest atoms) can jump
inside a step, which would add ``ΔE / 2h`` to a central difference. So for such an
energy each direction also compares the one-sided differences ``(E(+h) - E(0)) / h``
and ``(E(0) - E(-h)) / h``. Where they disagree by more than a quarter, each side is
measured again at half the step: the side whose half and full steps agree did not
cross the jump, and its one-sided differences (extrapolated to a zero step) are
used. ``E(0)`` is the reference energy, so a smooth direction costs no extra call,
and one with a jump two.

This module needs only numpy and ASE; it drives any ASE calculator, so the same
function checks a :class:`~rootstock.runtime.calculator.RootstockCalculator` in
``add`` and a model run in-process in a test.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from rootstock.install.envtables import VERIFY_CHECK_MODES

QUANTITIES = ("forces", "stress")
GRADIENT, DIRECT = "gradient", "direct"
SMOOTH, NON_SMOOTH = "smooth", "non-smooth"
# VERIFY_CHECKS modes each key may take. The table lives with the env-file lint
# (install/ must not import ops/); these are its names.
CHECK_MODES: dict[str, tuple[str, ...]] = VERIFY_CHECK_MODES
# |ratio - 1| allowed for a gradient quantity, by the dtype the model runs in.
RATIO_TOLERANCE = {"float64": 0.02, "float32": 0.10}
LOOSE_MIN_COSINE = 0.9
LOOSE_NORM_RATIO = (0.5, 2.0)
# One-sided differences that disagree by more than this fraction mean a jump.
JUMP_DISAGREEMENT = 0.25
# GPa per eV/Å³: a stress this many times the derivative is a unit error.
GPA_PER_EV_A3 = 160.21766208
# Finite-difference steps (Å for displacements, dimensionless for strains). float32
# energies carry ~1e-7 relative noise, so a larger step keeps it below the signal.
DEFAULT_STEP = {"float64": 1e-3, "float32": 1e-2}
FORCE_DIRECTIONS = 3


@dataclass(frozen=True)
class QuantityCheck:
    """The verdict on one quantity (``forces`` or ``stress``).

    ``mode`` is ``gradient``, ``direct`` (loose bound) or ``n/a`` (not checked,
    e.g. stress on a structure that is not 3-D periodic). ``ratio`` is model over
    finite difference; ``cosine`` and ``norm_ratio`` are what the loose bound
    judges. ``tol`` records the bound that was applied.
    """

    quantity: str
    mode: str
    ok: bool
    ratio: float | None = None
    cosine: float | None = None
    norm_ratio: float | None = None
    tol: dict[str, Any] = field(default_factory=dict)
    directions: int = 0
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as stored under a verification's ``checks``."""
        return {
            "mode": self.mode,
            "ok": self.ok,
            "ratio": _finite_or_none(self.ratio),
            "cosine": _finite_or_none(self.cosine),
            "norm_ratio": _finite_or_none(self.norm_ratio),
            "tol": dict(self.tol),
            "directions": self.directions,
            "message": self.message,
        }


@dataclass(frozen=True)
class ConsistencyReport:
    """Every quantity's check, the dtype rule applied, and the step used.

    ``dtype`` is the tolerance rule (``float64`` or ``float32``); ``model_dtype`` is
    what the caller said the model computes in (None when unknown).
    """

    dtype: str
    step: float
    checks: dict[str, QuantityCheck]
    energy_mode: str = SMOOTH
    model_dtype: str | None = None
    energy_calls: int = 0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks.values())

    @property
    def message(self) -> str | None:
        """The failures, one clause each ("" parts joined by "; "), or None."""
        failures = [c.message for c in self.checks.values() if not c.ok and c.message]
        return "; ".join(failures) or None

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``checks`` object (documented in docs/manifest.md)."""
        doc: dict[str, Any] = {
            "ok": self.ok,
            "dtype": self.dtype,
            "model_dtype": self.model_dtype,
            "step": self.step,
            "energy": self.energy_mode,
            "energy_calls": self.energy_calls,
        }
        doc.update({name: check.to_dict() for name, check in self.checks.items()})
        return doc


def dtype_rule(dtype: str | None, device: str | None = None) -> str:
    """The tolerance rule that applies: ``float64`` or ``float32``.

    Anything that is not float64 (float32, bfloat16, unknown) takes the float32
    rule, and so does a GPU, whose TF32 matmuls carry float32-level noise.
    """
    if device is not None and device.split(":", 1)[0].lower() in ("cuda", "gpu", "rocm", "xpu"):
        return "float32"
    return "float64" if dtype == "float64" else "float32"


def check_consistency(
    atoms: Any,
    calc: Any,
    *,
    dtype: str | None = "float64",
    device: str | None = None,
    modes: dict[str, str] | None = None,
    seed: int = 0,
    step: float | None = None,
    directions: int = FORCE_DIRECTIONS,
) -> ConsistencyReport:
    """Check ``calc``'s forces and stress against its energy on ``atoms``.

    ``atoms`` is left unchanged (a copy is displaced). ``modes`` is the env's
    ``VERIFY_CHECKS`` entry (``{"forces": "direct", "energy": "non-smooth"}``);
    missing keys mean gradient quantities of a smooth energy. About
    ``2 * directions + 2`` energy calls (``+ 4`` for a direct stress).
    """
    modes = dict(modes or {})
    rule = dtype_rule(dtype, device)
    h = float(step if step is not None else DEFAULT_STEP[rule])
    rng = np.random.default_rng(seed)
    work = atoms.copy()
    work.calc = calc
    energy_mode = modes.get("energy", SMOOTH)
    periodic = _is_3d_periodic(atoms)
    # Read at the reference geometry first: a calculator that has just computed them
    # (verification's forward pass) answers from its cache.
    forces = np.asarray(work.get_forces(), dtype=float)
    stress = _full_stress(np.asarray(work.get_stress(), dtype=float)) if periodic else None
    e0 = float(work.get_potential_energy()) if energy_mode == NON_SMOOTH else None
    positions = atoms.get_positions()
    calls = [0]

    def central(move: Callable[[float], object]) -> float:
        return _difference(work, h, move, e0, calls)

    model_f, fd_f = [], []
    for _ in range(directions):
        u = rng.standard_normal(positions.shape)
        u /= np.linalg.norm(u)
        model_f.append(-float(np.sum(forces * u)))
        fd_f.append(central(partial(_displace, work, positions, u)))
    work.set_positions(positions)
    checks = {
        "forces": _judge("forces", modes.get("forces", GRADIENT), energy_mode, rule, model_f, fd_f)
    }
    if stress is not None:
        stress_mode = modes.get("stress", GRADIENT)
        volume = atoms.get_volume()
        cell = atoms.get_cell().array
        model_s, fd_s = [], []
        count = 1 if stress_mode == GRADIENT and energy_mode == SMOOTH else directions
        for _ in range(count):
            strain = rng.standard_normal((3, 3))
            strain = (strain + strain.T) / 2
            strain /= np.linalg.norm(strain)
            model_s.append(volume * float(np.sum(stress * strain)))
            fd_s.append(central(partial(_strain, work, cell, positions, eps=strain)))
        checks["stress"] = _judge("stress", stress_mode, energy_mode, rule, model_s, fd_s)
    else:
        checks["stress"] = QuantityCheck(
            "stress", "n/a", True, message="not checked: the structure is not 3-D periodic"
        )
    return ConsistencyReport(rule, h, checks, energy_mode, dtype, calls[0])


def _difference(
    atoms: Any, h: float, move: Callable[[float], object], e0: float | None, calls: list[int]
) -> float:
    """The derivative of the energy along ``move``: central, or jump-aware given ``e0``."""

    def energy(step: float) -> float:
        calls[0] += 1
        move(step)
        return float(atoms.get_potential_energy())

    up, down = energy(h), energy(-h)
    central = (up - down) / (2 * h)
    if e0 is None:
        return central
    forward, backward = (up - e0) / h, (e0 - down) / h
    if _agree(forward, backward):
        return central
    half_forward = (energy(h / 2) - e0) / (h / 2)
    half_backward = (e0 - energy(-h / 2)) / (h / 2)
    clean_forward, clean_backward = _agree(forward, half_forward), _agree(backward, half_backward)
    if clean_forward != clean_backward:
        # One-sided differences are off by O(h); Richardson's 2 d(h/2) - d(h) is not.
        if clean_forward:
            return 2 * half_forward - forward
        return 2 * half_backward - backward
    return central  # jumps on both sides (or neither): nothing better to offer


def _agree(a: float, b: float) -> bool:
    return abs(a - b) <= JUMP_DISAGREEMENT * max(abs(a), abs(b))


def _displace(atoms: Any, positions: np.ndarray, u: np.ndarray, s: float) -> None:
    atoms.set_positions(positions + s * u)


def _strain(atoms: Any, cell: np.ndarray, positions: np.ndarray, s: float, eps: np.ndarray) -> None:
    deformation = np.eye(3) + s * eps
    atoms.set_cell(cell @ deformation, scale_atoms=False)
    atoms.set_positions(positions @ deformation)


def _full_stress(stress: np.ndarray) -> np.ndarray:
    if stress.shape == (3, 3):
        return stress
    xx, yy, zz, yz, xz, xy = stress
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])


def _is_3d_periodic(atoms: Any) -> bool:
    return bool(atoms.pbc.all()) and abs(atoms.cell.volume) > 1e-12


def _judge(
    quantity: str, mode: str, energy_mode: str, rule: str, model: list[float], fd: list[float]
) -> QuantityCheck:
    a, b = np.asarray(model), np.asarray(fd)
    count = len(a)
    norm_a, norm_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    what = "negative gradient" if quantity == "forces" else "strain derivative"
    subject = f"{quantity} {'are' if quantity == 'forces' else 'is'}"
    loose = mode == DIRECT or energy_mode == NON_SMOOTH
    if loose:
        tol: dict[str, Any] = {"min_cosine": LOOSE_MIN_COSINE, "norm_ratio": list(LOOSE_NORM_RATIO)}
    else:
        tol = {"ratio": RATIO_TOLERANCE[rule], "rule": rule}
    scale = max(norm_a, norm_b)
    if scale == 0.0 or not math.isfinite(scale):
        ok = scale == 0.0
        message = None if ok else f"{quantity} check is not finite"
        return QuantityCheck(quantity, mode, ok, None, None, None, tol, count, message)
    if norm_b == 0.0:
        message = f"{subject} non-zero where the {what} of the energy is zero"
        return QuantityCheck(quantity, mode, False, math.inf, None, math.inf, tol, count, message)
    ratio = float(a @ b) / float(b @ b)
    cosine = float(a @ b) / (norm_a * norm_b) if norm_a else 0.0
    norm_ratio = norm_a / norm_b
    if loose:
        low, high = LOOSE_NORM_RATIO
        ok = cosine >= LOOSE_MIN_COSINE and low <= norm_ratio <= high
        detail = (
            f"cosine {cosine:.3f}, norm ratio {norm_ratio:.3g}; allowed cosine >= "
            f"{LOOSE_MIN_COSINE} and norm ratio in [{low}, {high}]"
        )
    else:
        ok = abs(ratio - 1.0) <= tol["ratio"]
        detail = f"allowed 1 ± {tol['ratio']:g} in {rule}"
    message = None
    if not ok:
        message = f"{subject} {ratio:.4g}× the {what} of the energy{_diagnosis(ratio)} ({detail})"
    return QuantityCheck(quantity, mode, ok, ratio, cosine, norm_ratio, tol, count, message)


def _diagnosis(ratio: float) -> str:
    """A guess at the cause, for the failure message."""
    for factor in (GPA_PER_EV_A3, 1 / GPA_PER_EV_A3, -GPA_PER_EV_A3, -1 / GPA_PER_EV_A3):
        if abs(ratio / factor - 1.0) < 0.05:
            return ": a unit error (GPa vs eV/Å³?)"
    if abs(ratio + 1.0) < 0.1:
        return ": a sign error"
    if ratio < 0:
        return ": the wrong sign"
    return ""


def _finite_or_none(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return value
