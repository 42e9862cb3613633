"""How many manifest bodies the dashboard keeps per cluster (plain constants).

Every accepted push keeps a history row; only the newest ``keep_bodies`` rows of a
cluster keep their body (the JSON text as sent), older ones keep their metadata
(time, env and checkpoint counts) with the body dropped, in the push's own
transaction. Nothing here imports the web stack or SQLAlchemy: ``rootstock
dashboard serve`` reads these constants to build its ``--keep-bodies`` option.
"""

from __future__ import annotations

DEFAULT_KEEP_BODIES = 100
# A thousand times the default: past it the history is a second database of bodies
# (300 kB each for a 300-checkpoint manifest), not a record of recent pushes.
MAX_KEEP_BODIES = 100_000
KEEP_BODIES_ENV = "ROOTSTOCK_DASHBOARD_KEEP_BODIES"


def checked_keep_bodies(value: int) -> int:
    """``value`` when it is a whole number in ``1..MAX_KEEP_BODIES``; ValueError otherwise.

    Zero is refused rather than read as "keep none": the latest body is what
    ``GET .../manifest`` serves, so at least one must stay.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"keep_bodies must be a whole number, not {value!r}")
    if not 1 <= value <= MAX_KEEP_BODIES:
        raise ValueError(f"keep_bodies must be 1 to {MAX_KEEP_BODIES}, not {value}")
    return value
