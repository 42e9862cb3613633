"""The lint of ``evaluate_batch``, an env file's optional native batching hook.

The worker calls ``evaluate_batch(calc, atoms_list, properties)`` with three
positional arguments and nothing else, so the lint accepts any signature that can
take exactly that call (extra parameters need defaults) and rejects the rest with
the expected signature; ``async def`` is rejected too, since the worker never awaits.
"""

from __future__ import annotations

import ast

from rootstock.install.envtables import Report

EVALUATE_BATCH = "evaluate_batch"
EVALUATE_BATCH_SIGNATURE = "def evaluate_batch(calc, atoms_list, properties)"
_POSITIONAL = 3


def check_evaluate_batch(node: ast.FunctionDef | ast.AsyncFunctionDef, problem: Report) -> None:
    """Report ``problem`` unless ``node`` can be called as ``f(calc, atoms_list, properties)``.

    One problem per hook: the first thing that stops the worker's call.
    """
    fix = f"declare it as {EVALUATE_BATCH_SIGNATURE}, returning one dict or exception per item"
    if isinstance(node, ast.AsyncFunctionDef):
        problem(node.lineno, f"{EVALUATE_BATCH}() is async; the worker calls it directly", fix)
        return
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    required = len(positional) - len(args.defaults)
    if len(positional) < _POSITIONAL and args.vararg is None:
        names = ", ".join(a.arg for a in positional) or "nothing"
        problem(
            node.lineno,
            f"{EVALUATE_BATCH}() takes {len(positional)} positional argument(s) ({names}); "
            f"the worker passes {_POSITIONAL}",
            fix,
        )
        return
    if required > _POSITIONAL:
        extra = ", ".join(a.arg for a in positional[_POSITIONAL:required])
        problem(
            node.lineno,
            f"{EVALUATE_BATCH}() requires {required} positional arguments ({extra} has no "
            f"default); the worker passes {_POSITIONAL}",
            fix,
        )
        return
    missing = [
        a.arg
        for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
        if default is None
    ]
    if missing:
        problem(
            node.lineno,
            f"{EVALUATE_BATCH}() requires keyword-only argument(s) {', '.join(missing)}, "
            "which the worker never passes",
            fix,
        )
