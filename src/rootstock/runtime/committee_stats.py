"""A committee's numbers: the members' results in, the committee's values and spreads out.

Pure numpy, no worker: :class:`~rootstock.runtime.committee.CommitteeCalculator`
(single calls and ``calculate_batch``) feeds it one structure at a time.

Definitions (docs/committee.md):

- every spread is a population standard deviation over the members (``ddof=0``);
- ``energy``, ``free_energy``, ``forces`` and ``stress`` are the members' means, or
  the reference member's own values when the committee has one (the spreads are
  reported beside them either way);
- ``energy_std`` is the spread of the members' energies as they are. Models of
  different families put their zero of energy in different places, so it mixes
  those offsets with real disagreement;
- ``energy_std_relative`` is the spread of each member's energy *difference* from
  its own energy on a baseline structure (the first of the batch or trajectory),
  which cancels the offsets: use it to compare structures along a run;
- ``forces_std`` is the spread of each force component, ``(natoms, 3)``;
- ``max_force_dev = max_i sqrt(mean_m |F_mi - F̄_i|²)``, the largest spread of an
  atom's force vector (the usual active-learning criterion);
- ``stress_std`` is the spread of each Voigt stress component, ``(6,)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: What a member contributes, and what the committee reports of each.
MEMBER_KEYS = ("energy", "free_energy", "forces", "stress")


def member_values(result: Mapping[str, Any]) -> dict[str, Any]:
    """The comparable part of one member's result, as float64 copies."""
    out: dict[str, Any] = {}
    for name in MEMBER_KEYS:
        if name in result:
            value = np.array(result[name], dtype=np.float64)
            out[name] = float(value) if value.ndim == 0 else value
    return out


def combine(
    members: Mapping[str, Mapping[str, Any]],
    reference: str | None = None,
    baseline: Mapping[str, float] | None = None,
    dropped: Sequence[str] = (),
) -> dict[str, Any]:
    """The committee's result for one structure from its members' results.

    ``members`` maps each member id that computed the structure to its result (the
    keys of ``calc.results``); a key is combined only when every member has it.
    ``reference`` names the member whose values are reported (None: the mean).
    ``baseline`` maps member ids to their energies on the baseline structure;
    ``energy_std_relative`` is reported over the members that have one. ``dropped``
    is copied into the result.
    """
    if not members:
        raise ValueError("a committee result needs at least one member")
    ids = list(members)
    values = {m: member_values(members[m]) for m in ids}
    shared = [k for k in MEMBER_KEYS if all(k in values[m] for m in ids)]
    out: dict[str, Any] = {}
    for name in shared:
        stacked = np.stack([np.asarray(values[m][name], dtype=np.float64) for m in ids])
        if reference is not None and reference in values:
            chosen = np.array(values[reference][name], dtype=np.float64)
        else:
            chosen = stacked.mean(axis=0)
        out[name] = float(chosen) if chosen.ndim == 0 else chosen
        spread = stacked.std(axis=0)  # ddof=0: a population over the members
        if name == "energy":
            out["energy_std"] = float(spread)
            relative = [
                values[m]["energy"] - baseline[m] for m in ids if baseline and m in baseline
            ]
            if relative:
                out["energy_std_relative"] = float(np.std(relative))
        elif name == "forces":
            out["forces_std"] = spread
            # mean_m |F_mi - F̄_i|² is the sum over components of the ddof=0 variances.
            per_atom = np.sqrt((spread**2).sum(axis=1)) if len(spread) else spread[:, 0]
            out["max_force_dev"] = float(per_atom.max()) if len(per_atom) else 0.0
        elif name == "stress":
            out["stress_std"] = spread
    out["members"] = {
        m: {k: values[m][k] for k in ("energy", "forces", "stress") if k in values[m]} for m in ids
    }
    out["dropped"] = list(dropped)
    return out
