"""The floating-point dtype the model runs in, found once after ``setup()``.

Verification's physics check allows 2 % in float64 and 10 % in float32, so the
worker reports what the model really uses. torch is never imported here: it is
looked up in ``sys.modules`` only if the model's own code already loaded it, so a
numpy-only model (EMT) costs nothing and reports ``float64``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

# Attributes that hold the network in the calculators we know (CHGNet and MACE:
# ``model``/``models``, matgl: ``potential``, fairchem: ``predictor.model``); read
# with getattr too, since some calculators expose them as properties.
MODEL_ATTRIBUTES = ("model", "models", "potential", "predictor", "module", "net")
# How many items of a list, tuple or dict attribute are looked at (an ensemble's
# first member speaks for the others).
ITEMS_PER_CONTAINER = 4


def _children(obj: Any) -> list[Any]:
    """The objects directly reachable from ``obj``: its attributes and their items."""
    values: list[Any] = []
    with contextlib.suppress(TypeError):  # no __dict__ (slots, builtins)
        values.extend(vars(obj).values())
    for name in MODEL_ATTRIBUTES:
        try:
            value = getattr(obj, name, None)
        except Exception:  # a property of foreign code may raise anything
            continue
        if value is not None:
            values.append(value)
    children: list[Any] = []
    for value in values:
        if isinstance(value, list | tuple):
            children.extend(value[:ITEMS_PER_CONTAINER])
        elif isinstance(value, dict):
            children.extend(list(value.values())[:ITEMS_PER_CONTAINER])
        else:
            children.append(value)
    return children


def find_module(calc: Any, module_type: type, depth: int = 2) -> Any | None:
    """The first instance of ``module_type`` reachable from ``calc`` within ``depth`` levels.

    ``calc`` itself counts; then its attributes (``calc.model``, items of
    ``calc.models``), then theirs (``calc.predictor.model``). Breadth first, so the
    shallowest match wins.
    """
    level = [calc]
    seen: set[int] = set()
    for current in range(depth + 1):
        following: list[Any] = []
        for obj in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, module_type):
                return obj
            if current < depth:
                following.extend(_children(obj))
        level = following
    return None


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``float32`` (numpy dtypes pass through by name)."""
    return str(dtype).removeprefix("torch.")


def first_floating_dtype(module: Any) -> str | None:
    """The dtype of the first floating-point parameter of a torch module, if any."""
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return dtype_name(parameter.dtype)
    return None


def detect_model_dtype(calc: Any) -> str:
    """The dtype the model computes in: ``float64``, ``float32``, ``bfloat16``, ...

    With torch loaded by the model: the first floating parameter of a
    ``torch.nn.Module`` reachable from the calculator, else torch's default dtype.
    Without torch (EMT, numpy models): ``float64``.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return "float64"
    module = find_module(calc, torch.nn.Module)
    if module is not None:
        found = first_floating_dtype(module)
        if found is not None:
            return found
    return dtype_name(torch.get_default_dtype())
