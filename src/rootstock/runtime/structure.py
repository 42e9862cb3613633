"""What the client reads off a structure, and makes of a worker's reply, for any call.

The single calculation (:mod:`rootstock.runtime.calculator`) and the batch
(:mod:`rootstock.runtime.batch`) both send ``atoms.info`` as :func:`info_json`, ask
for a stress only when :func:`is_3d_periodic`, and turn the worker's virial into
ASE's Voigt stress with :func:`stress_from_virial`, so the two paths agree to the bit.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

log = logging.getLogger("rootstock.calculator")


def _json_default(value: Any) -> Any:
    # numpy scalars and arrays are common in atoms.info (ASE readers put them there).
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def info_json(info: dict[str, Any]) -> str:
    """The JSON-serialisable part of ``atoms.info``, as canonical JSON text.

    Values that cannot be serialised (objects, say) are left out: they cannot
    reach the worker, which never unpickles.
    """
    if not info:
        return "{}"
    try:
        return json.dumps(info, sort_keys=True, default=_json_default)
    except (TypeError, ValueError):
        pass
    kept = {}
    for key, value in info.items():
        try:
            json.dumps(value, default=_json_default)
        except (TypeError, ValueError):
            log.debug("atoms.info[%r] is not JSON-serialisable; not forwarded", key)
            continue
        kept[str(key)] = value
    return json.dumps(kept, sort_keys=True, default=_json_default)


def is_3d_periodic(atoms: Any) -> bool:
    """True for a cell that is periodic in all three directions with three vectors."""
    # Written out because Cell.rank costs more than the rest of a call's bookkeeping.
    a, b, c = atoms.cell.array
    return bool(atoms.pbc.all() and a.any() and b.any() and c.any())


def stress_from_virial(virial: np.ndarray, atoms: Any) -> np.ndarray:
    """ASE's Voigt stress (xx, yy, zz, yz, xz, xy) from the worker's 3x3 virial."""
    sigma = -virial / atoms.cell.volume
    return np.array(
        [
            sigma[0, 0],
            sigma[1, 1],
            sigma[2, 2],
            (sigma[1, 2] + sigma[2, 1]) / 2,
            (sigma[0, 2] + sigma[2, 0]) / 2,
            (sigma[0, 1] + sigma[1, 0]) / 2,
        ]
    )
