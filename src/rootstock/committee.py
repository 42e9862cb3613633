"""Committees of checkpoints: ``CommitteeCalculator``, ``watch`` and ``UncertaintyExceeded``.

``from rootstock.committee import watch`` is the public face of the runtime's
committee modules (:mod:`rootstock.runtime.committee`,
:mod:`rootstock.runtime.committee_watch`); nothing is defined here. See
docs/committee.md.
"""

from __future__ import annotations

from rootstock.runtime import CommitteeCalculator, UncertaintyExceeded
from rootstock.runtime import watch_committee as watch

__all__ = ["CommitteeCalculator", "UncertaintyExceeded", "watch"]
