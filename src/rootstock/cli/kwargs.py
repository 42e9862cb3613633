"""``--kwarg K=V`` parsing, shared by add and serve.

It turns command-line text into the ``setup()`` keywords that the ops take, so it
lives with the other parsing of the CLI. The depth bound is
:data:`rootstock.install.parsing.MAX_KWARG_DEPTH`, shared with ``--setup-kwargs``.
"""

from __future__ import annotations

from typing import Any

from rootstock.errors import UsageError
from rootstock.install.parsing import MAX_KWARG_DEPTH

_EXAMPLE = "e.g. --kwarg task=omat or --kwarg 'heads=[\"omat\"]'"


def parse_kwargs(
    pairs: tuple[str, ...] | list[str], max_depth: int = MAX_KWARG_DEPTH
) -> dict[str, Any] | None:
    """``K=V`` pairs to a dict; values are JSON-decoded first, else kept as strings.

    A value that is not standard JSON (``task=omat``, ``x=NaN``) stays the string
    it was typed as. JSON nested deeper than ``max_depth`` is a
    :class:`~rootstock.errors.UsageError`, and so are a key with whitespace or a
    control character (a typo, never a keyword) and a key given twice. No pairs at
    all returns None, which means "use the env's VERIFY_KWARGS".
    """
    from rootstock.install.parsing import ParseProblem, TooDeep, loads_json

    if not pairs:
        return None
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--kwarg {pair!r} is not KEY=VALUE", hint=_EXAMPLE)
        if not key.isprintable() or any(c.isspace() for c in key):
            # ``--kwarg "task =omat"`` would otherwise reach setup() as the key "task ".
            raise UsageError(
                f"--kwarg key {key!r} has a space or a control character", hint=_EXAMPLE
            )
        if key in result:
            raise UsageError(
                f"--kwarg {key} is given twice", hint="give each keyword once (the last would win)"
            )
        try:
            result[key] = loads_json(value, max_depth=max_depth)
        except TooDeep:
            raise UsageError(
                f"--kwarg {key}: the JSON value is nested deeper than {max_depth} levels",
                hint=f"setup() keywords nest at most {max_depth} levels; pass a flatter value",
            ) from None
        except ParseProblem:
            result[key] = value  # plain text: a string, as typed
    return result
