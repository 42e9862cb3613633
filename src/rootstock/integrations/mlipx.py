"""mlipx models that run a Rootstock checkpoint (``rootstock[mlipx]``).

:func:`rootstock_model` gives mlipx's own ``GenericASECalculator`` node config for a
checkpoint: it builds a :class:`~rootstock.RootstockCalculator` in each stage that
needs the model, so every mlipx node (``StructureOptimization``,
``MolecularDynamics``, ...) and recipe (``models.py``) takes it like any other model.
mlipx's device is left unset (``"auto"`` would import torch in the client's Python);
the device goes to the calculator instead. See docs/integrations.md.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from rootstock.errors import UsageError
from rootstock.parallel import require_extra

require_extra("mlipx", ("mlipx", "zntrack"))

# Imported by name so that mypy, in an env without mlipx, sees it as Any.
_generic_ase: Any = importlib.import_module("mlipx.nodes.generic_ase")

__all__ = ["rootstock_model"]

# The calculator each stage builds, as mlipx's GenericASECalculator imports it.
_MODULE = "rootstock"
_CLASS_NAME = "RootstockCalculator"


def rootstock_model(
    checkpoint: str,
    root: str | os.PathLike[str] | None = None,
    cluster: str | None = None,
    device: str = "cpu",
    **calculator_kwargs: Any,
) -> Any:
    """mlipx's ``GenericASECalculator`` for a Rootstock ``checkpoint``.

    ``root``, ``cluster`` and ``device`` are :class:`~rootstock.RootstockCalculator`'s;
    ``calculator_kwargs`` go to it too (``setup_kwargs``, ``timeout``, ``pool``, ...).
    zntrack writes them to ``params.yaml``, so they must be JSON-serialisable; a
    ``root`` path is stored as a string.
    """
    if not isinstance(checkpoint, str) or not checkpoint:
        raise UsageError(
            f"checkpoint must be a non-empty string, not {checkpoint!r}",
            hint="pass a checkpoint id; `rootstock list` shows the ids your install serves",
        )
    kwargs: dict[str, Any] = {"checkpoint": checkpoint, "device": device}
    if root is not None:
        kwargs["root"] = os.fspath(root)
    if cluster is not None:
        kwargs["cluster"] = cluster
    kwargs.update(calculator_kwargs)
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"the calculator arguments for {checkpoint!r} cannot be stored in params.yaml: {exc}",
            hint="pass only strings, numbers, booleans, lists and dicts of them",
        ) from None
    return _generic_ase.GenericASECalculator(
        module=_MODULE, class_name=_CLASS_NAME, kwargs=kwargs, device=None
    )
