"""``--kwarg K=V`` parsing, shared by add and serve."""

from __future__ import annotations

import json
from typing import Any

from rootstock.errors import UsageError


def parse_kwargs(pairs: tuple[str, ...] | list[str]) -> dict[str, Any] | None:
    """``K=V`` pairs to a dict; values are JSON-decoded first, else kept as strings.

    No pairs at all returns None, which means "use the env's VERIFY_KWARGS".
    """
    if not pairs:
        return None
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--kwarg {pair!r} is not KEY=VALUE", hint="e.g. --kwarg task=omat")
        try:
            result[key] = json.loads(value)
        except ValueError:
            result[key] = value
    return result
