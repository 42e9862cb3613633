"""Fingerprints of a verification result, and whether two of them agree.

A fingerprint is the small summary of one forward pass on the reference structure
that the manifest keeps: energy per atom, the norm of the force array and the six
Voigt stress components, plus the device kind and versions it ran with. Comparing a
new fingerprint with the accepted *reference* is how a rebuild or ``--upgrade`` that
silently changed the physics is noticed (the ``drifted`` state). References are
filed by cluster, device kind and setup kwargs (:func:`kwargs_key`), so a pass is
only ever compared with one that ran the same model the same way.

The test is relative to the magnitude, with a small absolute floor per quantity::

    |new - ref| <= max(rtol * max(|new|, |ref|), atol)

For the stress, the magnitude is the largest component of either tensor, so a
near-zero off-diagonal component is judged on the scale of the whole tensor.
The defaults pass float32 noise (relative ~1e-6, GPU reduction order included)
and catch a 0.1 % change once the change is above the floor: energies beyond
0.01 eV/atom, force norms beyond 0.1 eV/Å. (Near-equilibrium EMT Cu sits at about
0.01 eV/atom, where 0.1 % is noise-sized; test drift on a compressed cell.)

Stdlib only: ``status`` imports this and must stay fast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# The references key of a v1 reference, set before records said which setup kwargs
# a pass ran with. Every real key is a JSON object's text, so it cannot clash.
UNRECORDED_KWARGS = "unrecorded"

NUMERIC_QUANTITIES = ("energy_per_atom", "force_norm", "stress")
_UNITS = {"energy_per_atom": "eV/atom", "force_norm": "eV/Å", "stress": "eV/Å³"}


@dataclass(frozen=True)
class FingerprintTolerance:
    """How far a re-verification may move before it counts as drifted.

    ``rtol`` applies to every quantity; the ``*_atol`` floors keep quantities that
    sit near zero (an equilibrium structure's forces) from tripping on noise.
    """

    rtol: float = 2e-4
    energy_atol: float = 1e-5  # eV/atom
    force_atol: float = 1e-4  # eV/Å
    stress_atol: float = 1e-6  # eV/Å³ (about 0.16 MPa)

    def atol_for(self, quantity: str) -> float:
        """The absolute floor for one of :data:`NUMERIC_QUANTITIES`."""
        return {
            "energy_per_atom": self.energy_atol,
            "force_norm": self.force_atol,
            "stress": self.stress_atol,
        }[quantity]

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> FingerprintTolerance:
        """Build from a mapping such as a ``[fingerprint]`` config table; unknown keys fail."""
        values = dict(values or {})
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown fingerprint tolerance keys: {sorted(unknown)}")
        return cls(**{k: float(v) for k, v in values.items()})

    def to_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return asdict(self)


DEFAULT_TOLERANCE = FingerprintTolerance()


def device_kind(device: str) -> str:
    """The kind a device string counts as: ``"cpu"``, ``"gpu"`` or ``"xpu"``.

    ``cuda``, ``cuda:1``, ``rocm`` and ``mps`` are GPUs; ``xpu:0`` is an Intel XPU.
    A pass counts only for its kind: a CPU pass is not a GPU pass.
    """
    base = device.strip().lower().split(":", 1)[0]
    if base in ("cuda", "gpu", "rocm", "hip", "mps"):
        return "gpu"
    if base == "xpu":
        return "xpu"
    return base or "cpu"


def canonical_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``kwargs`` as the manifest stores them: JSON types, keys sorted.

    A value JSON cannot hold (a tuple, a path) is stored as JSON makes it (a list)
    or, failing that, as its ``str``, so the stored form is always loadable.
    """
    return json.loads(kwargs_key(kwargs))


def kwargs_key(kwargs: dict[str, Any] | None) -> str:
    """The key a reference fingerprint is filed under: the setup kwargs as compact JSON.

    Two passes are compared only when they ran with the same kwargs (a different
    ``modal=`` or ``head=`` is a different model, not a drift); ``{}`` and None are
    the same: no kwargs.
    """
    return json.dumps(kwargs or {}, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class QuantityDrift:
    """One quantity that moved beyond tolerance."""

    quantity: str
    reference: float | list[float] | None
    value: float | list[float] | None
    abs_diff: float | None
    rel_diff: float | None
    allowed: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (non-finite numbers become None)."""
        return {k: _json_number(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class FingerprintComparison:
    """The verdict of :func:`compare_fingerprints`: ``within`` and what drifted."""

    within: bool
    drifts: list[QuantityDrift] = field(default_factory=list)
    tolerance: FingerprintTolerance = DEFAULT_TOLERANCE

    @property
    def message(self) -> str:
        """One line naming each drifted quantity and by how much ("" when within)."""
        return "; ".join(d.reason for d in self.drifts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as stored under a verification's ``drift`` key."""
        return {
            "within": self.within,
            "drifts": [d.to_dict() for d in self.drifts],
            "message": self.message,
            "tolerance": self.tolerance.to_dict(),
        }


def compare_fingerprints(
    reference: Mapping[str, Any],
    new: Mapping[str, Any],
    tolerance: FingerprintTolerance | None = None,
) -> FingerprintComparison:
    """Compare ``new`` with the accepted ``reference`` fingerprint.

    Only the numeric quantities are compared; versions and device kind are context.
    A quantity present in one fingerprint and absent (None) in the other counts as
    drifted, as does any non-finite value.
    """
    tol = tolerance or DEFAULT_TOLERANCE
    drifts = []
    for quantity in NUMERIC_QUANTITIES:
        drift = _compare_quantity(quantity, reference.get(quantity), new.get(quantity), tol)
        if drift is not None:
            drifts.append(drift)
    return FingerprintComparison(not drifts, drifts, tol)


def _compare_quantity(
    quantity: str, ref: Any, new: Any, tol: FingerprintTolerance
) -> QuantityDrift | None:
    unit = _UNITS[quantity]
    if ref is None and new is None:
        return None
    if ref is None or new is None:
        said = "now missing" if new is None else "newly present"
        return QuantityDrift(quantity, ref, new, None, None, None, f"{quantity} {said}")
    ref_values, new_values = _as_floats(ref), _as_floats(new)
    if ref_values is None or new_values is None or len(ref_values) != len(new_values):
        return QuantityDrift(
            quantity, ref, new, None, None, None, f"{quantity} changed shape or type"
        )
    if not all(math.isfinite(v) for v in (*ref_values, *new_values)):
        return QuantityDrift(quantity, ref, new, None, None, None, f"{quantity} is not finite")
    scale = max((abs(v) for v in (*ref_values, *new_values)), default=0.0)
    allowed = max(tol.rtol * scale, tol.atol_for(quantity))
    abs_diff = max((abs(a - b) for a, b in zip(ref_values, new_values, strict=True)), default=0.0)
    if abs_diff <= allowed:
        return None
    rel_diff = abs_diff / scale if scale else math.inf
    if isinstance(ref, list):
        detail = f"max component moved by {abs_diff:.3g} {unit}"
    else:
        detail = f"{ref:.6g} -> {new:.6g} {unit}"
    reason = (
        f"{quantity} drifted by {rel_diff:.2e} relative ({detail}; allowed {allowed:.2g} {unit})"
    )
    return QuantityDrift(quantity, ref, new, abs_diff, rel_diff, allowed, reason)


def _as_floats(value: Any) -> list[float] | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, list | tuple) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        return [float(v) for v in value]
    return None


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
