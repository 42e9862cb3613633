"""Rootstock: many MLIPs from one ASE calculator, each in its own pre-built env.

The package import is kept light on purpose: the CLI's ``--help`` and the worker's
start-up both import it, so numpy, ase and rich are only pulled in by the modules
that need them. ``RootstockCalculator``, ``CommitteeCalculator``, ``evaluate`` and
``evaluate_iter`` load on first access; ``rootstock.committee`` is a module of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rootstock.errors import RootstockError, WorkerDiedError, WorkerError
from rootstock.version import __version__

__all__ = [
    "CommitteeCalculator",
    "RootstockCalculator",
    "RootstockError",
    "WorkerDiedError",
    "WorkerError",
    "__version__",
    "evaluate",
    "evaluate_iter",
]

if TYPE_CHECKING:
    from rootstock.parallel.evaluation import evaluate, evaluate_iter
    from rootstock.runtime import CommitteeCalculator, RootstockCalculator


def __getattr__(name: str) -> Any:
    if name == "RootstockCalculator":
        from rootstock.runtime import RootstockCalculator

        return RootstockCalculator
    if name == "CommitteeCalculator":
        from rootstock.runtime import CommitteeCalculator

        return CommitteeCalculator
    if name == "committee":
        import importlib

        return importlib.import_module("rootstock.committee")
    if name in ("evaluate", "evaluate_iter"):
        from rootstock.parallel import evaluation

        return getattr(evaluation, name)
    raise AttributeError(f"module 'rootstock' has no attribute {name!r}")
