"""Scale-out: ``rootstock.evaluate`` on Parsl or Dask, one warm worker per engine worker.

The engines are extras (``pip install 'rootstock[parsl]'``, ``'rootstock[dask]'``);
their names here load on first access, so a missing extra is an error naming it.
See docs/scale-out.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rootstock.errors import MissingExtra

if TYPE_CHECKING:
    from rootstock.parallel.dask_engine import (
        RootstockPlugin,
        dask_local_client,
        dask_slurm_client,
    )
    from rootstock.parallel.parsl_engine import (
        parsl_local_config,
        parsl_slurm_config,
        shutdown,
    )

__all__ = [
    "RootstockPlugin",
    "dask_local_client",
    "dask_slurm_client",
    "parsl_local_config",
    "parsl_slurm_config",
    "shutdown",
]

# name -> (module, the extra that brings its engine, the engine's import names)
_LAZY = {
    "parsl_slurm_config": ("parsl_engine", "parsl", ("parsl",)),
    "parsl_local_config": ("parsl_engine", "parsl", ("parsl",)),
    "shutdown": ("parsl_engine", "parsl", ("parsl",)),
    "dask_slurm_client": ("dask_engine", "dask", ("distributed", "dask_jobqueue")),
    "dask_local_client": ("dask_engine", "dask", ("distributed", "dask_jobqueue")),
    "RootstockPlugin": ("dask_engine", "dask", ("distributed", "dask_jobqueue")),
}


def require_extra(extra: str, modules: tuple[str, ...]) -> None:
    """MissingExtra naming ``pip install 'rootstock[EXTRA]'`` unless ``modules`` import."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtra(
                f"rootstock's {extra} support needs {module!r}, which is not installed "
                f"in this Python ({exc})",
                hint=f"pip install 'rootstock[{extra}]' (or uv pip install 'rootstock[{extra}]')",
            ) from None


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rootstock.parallel' has no attribute {name!r}")
    module, extra, modules = _LAZY[name]
    require_extra(extra, modules)
    return getattr(importlib.import_module(f"rootstock.parallel.{module}"), name)
