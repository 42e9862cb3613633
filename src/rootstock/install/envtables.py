"""Validation of the literal tables of an env file, once ``ast`` has evaluated them.

Each reader takes the evaluated value and the line it came from, reports every
problem through ``problem(line, message, fix)`` and returns what is usable. They
know nothing of files; :mod:`rootstock.install.envfile` wires them together.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypedDict, cast

CHECKPOINT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?::custom)?$")
CUSTOM_SUFFIX = ":custom"
VERIFY_STRUCTURE_KEYS = ("symbols", "positions", "cell", "pbc")
# The physics checks of verification and the modes an env may declare for each in
# VERIFY_CHECKS (rootstock.ops.consistency judges by them; the first is the default).
VERIFY_CHECK_MODES: dict[str, tuple[str, ...]] = {
    "forces": ("gradient", "direct"),
    "stress": ("gradient", "direct"),
    "energy": ("smooth", "non-smooth"),
}
VERIFY_CHECKS_EXAMPLE = 'VERIFY_CHECKS = {"my-model-1": {"forces": "direct", "stress": "direct"}}'
SETUP_FROM_PATH_SIGNATURE = 'def setup_from_path(path, device="cuda", **kw)'
STRUCTURE_EXAMPLE = (
    'VERIFY_STRUCTURE = {"symbols": ["Cu"], "positions": [[0, 0, 0]], '
    '"cell": [[0, 1.8, 1.8], [1.8, 0, 1.8], [1.8, 1.8, 0]], "pbc": True}'
)

# problem(line, message, fix): how every reader reports what it finds.
Report = Callable[[int, str, str], None]


class CheckpointInfo(TypedDict, total=False):
    """What a checkpoint is (``CHECKPOINT_INFO[id]``); every field is optional."""

    licence: str  # an SPDX id or expression, "proprietary", or "custom:<url>"
    gated: str | None  # None, or the URL where access is requested
    source: str  # where the weights come from
    citation: str  # a DOI (10.x/y) or an arXiv id (arXiv:YYMM.NNNNN)
    training_data: str
    summary: str


CHECKPOINT_INFO_FIELDS: tuple[str, ...] = tuple(CheckpointInfo.__annotations__)
CHECKPOINT_INFO_EXAMPLE = (
    'CHECKPOINT_INFO = {"my-model-1": {"licence": "MIT", "citation": "10.1000/xyz"}}'
)
# An SPDX id (MIT, Apache-2.0, LicenseRef-x) or an expression of them (MIT OR Apache-2.0).
_SPDX_ID = r"\(?[A-Za-z0-9][A-Za-z0-9.+-]*\)?"
_SPDX_RE = re.compile(rf"^{_SPDX_ID}(?: (?:AND|OR|WITH) {_SPDX_ID})*$")
_URL_RE = re.compile(r"^https?://[^\s/]+\S*$")
_DOI_RE = re.compile(r"^10\.\d{4,9}/\S+$")
_ARXIV_RE = re.compile(r"^arXiv:(?:\d{4}\.\d{4,5}|[a-z-]+(?:\.[A-Z]{2})?/\d{7})(?:v\d+)?$")


def is_custom_id(checkpoint: str) -> bool:
    """True for ``<family>:custom`` ids, which take user-supplied weights."""
    return checkpoint.endswith(CUSTOM_SUFFIX)


def read_checkpoints(
    table: Any,
    line: int,
    id_lines: dict[str, int],
    has_setup_from_path: bool,
    problem: Report,
) -> dict[str, str | None]:
    """The valid ``{id: upstream}`` entries of ``CHECKPOINTS``."""
    if not isinstance(table, dict):
        problem(
            line,
            f"CHECKPOINTS is a {type(table).__name__}; it must be a dict {{id: upstream-string}}",
            'write CHECKPOINTS = {"my-model-1": "upstream-name"}',
        )
        return {}
    if not table:
        problem(
            line,
            "CHECKPOINTS is empty, so this env would serve nothing",
            'declare at least one id: CHECKPOINTS = {"my-model-1": "upstream-name"}',
        )
        return {}
    checkpoints: dict[str, str | None] = {}
    for key, value in table.items():
        at = id_lines.get(key, line) if isinstance(key, str) else line
        if not isinstance(key, str) or not CHECKPOINT_ID_RE.match(key):
            problem(
                at,
                f"checkpoint id {key!r} is not allowed",
                "use [A-Za-z0-9][A-Za-z0-9._-]*, or <family>:custom",
            )
            continue
        if is_custom_id(key):
            if value is not None and not isinstance(value, str):
                problem(
                    at, f"CHECKPOINTS[{key!r}] must be None or a string", f'write "{key}": None'
                )
                continue
            if not has_setup_from_path:
                problem(
                    at,
                    f"{key!r} takes user weights but there is no setup_from_path()",
                    f"define {SETUP_FROM_PATH_SIGNATURE}, or drop the entry",
                )
        elif not isinstance(value, str):
            problem(
                at,
                f"CHECKPOINTS[{key!r}] is {value!r}; it must be a string",
                "give the upstream name or path; None is allowed only for <family>:custom",
            )
            continue
        elif not value.strip():
            problem(
                at,
                f"CHECKPOINTS[{key!r}] is an empty string",
                "give the upstream name that setup() loads for this id",
            )
            continue
        checkpoints[key] = value
    return checkpoints


def is_json_value(value: Any) -> bool:
    """True for what survives the trip to the worker as JSON unchanged."""
    if value is None or isinstance(value, str | bool | int | float):
        return True
    if isinstance(value, list):
        return all(is_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_value(v) for k, v in value.items())
    return False


def read_verify_kwargs(
    table: Any,
    line: int,
    key_lines: dict[str, int],
    declared: dict[str, str | None],
    problem: Report,
) -> dict[str, dict[str, Any]]:
    """The valid ``{id: {kwarg: value}}`` entries of ``VERIFY_KWARGS``."""
    if not isinstance(table, dict):
        problem(
            line,
            "VERIFY_KWARGS must be a dict {checkpoint-id: {kwarg: value}}",
            'write VERIFY_KWARGS = {"my-model-1": {"task": "omat"}}',
        )
        return {}
    kwargs: dict[str, dict[str, Any]] = {}
    for key, value in table.items():
        at = key_lines.get(key, line) if isinstance(key, str) else line
        if key not in declared:
            problem(
                at,
                f"VERIFY_KWARGS names {key!r}, which CHECKPOINTS does not declare",
                "use a declared checkpoint id as the key, or remove the entry",
            )
            continue
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            problem(
                at,
                f"VERIFY_KWARGS[{key!r}] must be a dict of keyword arguments",
                f'write "{key}": {{"name": value}}',
            )
            continue
        if not is_json_value(value):
            problem(
                at,
                f"VERIFY_KWARGS[{key!r}] holds a value JSON cannot carry to the worker",
                "use only strings, numbers, booleans, None, lists and dicts",
            )
            continue
        kwargs[key] = value
    return kwargs


def read_verify_checks(
    table: Any,
    line: int,
    key_lines: dict[str, int],
    declared: dict[str, str | None],
    problem: Report,
    inner_lines: dict[str, dict[str, int]] | None = None,
) -> dict[str, dict[str, str]]:
    """The valid ``{id: {quantity: mode}}`` entries of ``VERIFY_CHECKS``.

    Quantities and their modes are those of :data:`VERIFY_CHECK_MODES`; an entry with
    any unknown quantity or mode is dropped whole, so verification never half-applies it.
    ``inner_lines[id][quantity]`` is the line of each quantity, where a problem points.
    """
    if not isinstance(table, dict):
        problem(
            line,
            "VERIFY_CHECKS must be a dict {checkpoint-id: {quantity: mode}}",
            f"write {VERIFY_CHECKS_EXAMPLE}",
        )
        return {}
    checks: dict[str, dict[str, str]] = {}
    for key, value in table.items():
        at = key_lines.get(key, line) if isinstance(key, str) else line
        if key not in declared:
            problem(
                at,
                f"VERIFY_CHECKS declares checks for {key!r}, an id CHECKPOINTS does not declare",
                "use a declared checkpoint id as the key, or remove the entry",
            )
            continue
        if not isinstance(value, dict):
            problem(
                at,
                f"VERIFY_CHECKS[{key!r}] must be a dict {{quantity: mode}}",
                f'write "{key}": {{"forces": "direct"}}',
            )
            continue
        valid = True
        for quantity, mode in value.items():
            here = (inner_lines or {}).get(key, {}).get(quantity, at)
            if quantity not in VERIFY_CHECK_MODES:
                problem(
                    here,
                    f"VERIFY_CHECKS[{key!r}] checks an unknown quantity {quantity!r}",
                    f"use only {', '.join(VERIFY_CHECK_MODES)} as keys",
                )
                valid = False
                continue
            allowed = VERIFY_CHECK_MODES[quantity]
            if mode not in allowed:
                problem(
                    here,
                    f"VERIFY_CHECKS[{key!r}][{quantity!r}] is {mode!r}, not a mode of {quantity}",
                    f"use one of the {quantity} modes: {', '.join(allowed)} (docs/environments.md)",
                )
                valid = False
        if valid:
            checks[key] = dict(value)
    return checks


def read_clusters(table: Any, line: int, problem: Report) -> list[str] | None:
    """The lower-cased cluster names of a ``CLUSTERS`` variant, or None if invalid."""
    if not isinstance(table, list | tuple) or not all(isinstance(c, str) and c for c in table):
        problem(line, "CLUSTERS must be a list of cluster names", 'write CLUSTERS = ["della"]')
        return None
    if not table:
        problem(
            line,
            "CLUSTERS is empty, so this variant would apply nowhere",
            "list the clusters it is for, or delete CLUSTERS to make it universal",
        )
        return None
    return list(dict.fromkeys(c.lower() for c in table))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _vectors(value: Any, count: int) -> bool:
    """True for exactly ``count`` rows of three numbers."""
    return (
        isinstance(value, list | tuple)
        and len(value) == count
        and all(
            isinstance(v, list | tuple) and len(v) == 3 and all(_is_number(x) for x in v)
            for v in value
        )
    )


def _structure_symbols(symbols: Any) -> list[str] | None:
    """The element symbols of a structure, or None when they are not valid."""
    from ase.data import chemical_symbols
    from ase.symbols import string2symbols

    if isinstance(symbols, str):
        try:
            return string2symbols(symbols) or None
        except (ValueError, KeyError):
            return None
    if isinstance(symbols, list | tuple) and all(
        isinstance(s, str) and s in chemical_symbols[1:] for s in symbols
    ):
        return list(symbols) or None
    return None


def _valid_pbc(pbc: Any) -> bool:
    if isinstance(pbc, bool):
        return True
    return isinstance(pbc, list | tuple) and len(pbc) == 3 and all(isinstance(p, bool) for p in pbc)


def read_verify_structure(table: Any, line: int, problem: Report) -> dict[str, Any] | None:
    """``VERIFY_STRUCTURE`` if it describes a structure ASE can build, else None."""
    if not isinstance(table, dict):
        problem(
            line,
            "VERIFY_STRUCTURE must be a dict with symbols and positions",
            f"write {STRUCTURE_EXAMPLE}",
        )
        return None
    unknown = sorted(str(k) for k in table if k not in VERIFY_STRUCTURE_KEYS)
    if unknown:
        problem(
            line,
            f"VERIFY_STRUCTURE has unknown keys {unknown}",
            f"use only {', '.join(VERIFY_STRUCTURE_KEYS)}",
        )
        return None
    symbols = _structure_symbols(table.get("symbols"))
    if not symbols:
        problem(
            line,
            "VERIFY_STRUCTURE symbols are missing or not chemical elements",
            'write symbols = ["Cu", "Cu"] or a formula such as "Cu2"',
        )
        return None
    if not _vectors(table.get("positions"), len(symbols)):
        problem(
            line,
            f"VERIFY_STRUCTURE positions must be {len(symbols)} [x, y, z] rows of numbers, "
            "one per symbol",
            "give one [x, y, z] row in Å for each symbol, in the same order",
        )
        return None
    cell, pbc = table.get("cell"), table.get("pbc", False)
    if cell is not None and not _vectors(cell, 3):
        problem(
            line,
            "VERIFY_STRUCTURE cell must be 3 rows of 3 numbers (Å)",
            "write cell = [[a1x, a1y, a1z], [a2x, a2y, a2z], [a3x, a3y, a3z]]",
        )
        return None
    if not _valid_pbc(pbc):
        problem(
            line,
            "VERIFY_STRUCTURE pbc must be True, False or three booleans",
            "write pbc = True, or per axis, e.g. pbc = [True, True, False]",
        )
        return None
    if cell is None and (pbc is True or (isinstance(pbc, list | tuple) and any(pbc))):
        problem(
            line,
            "VERIFY_STRUCTURE is periodic but has no cell",
            "add cell = [[a, 0, 0], [0, b, 0], [0, 0, c]], or set pbc = False",
        )
        return None
    return table


def _info_value_problem(name: str, value: Any) -> tuple[str, str] | None:
    """``(what is wrong, how to write it)`` for one CHECKPOINT_INFO field, or None."""
    if name == "gated":
        if value is None or (isinstance(value, str) and _URL_RE.match(value)):
            return None
        return "must be None or the URL where access is requested", '"gated": "https://..."'
    if not isinstance(value, str) or not value.strip():
        return f"is {value!r}; it must be a non-empty string", f'"{name}": "..."'
    if name == "licence" and not (
        value == "proprietary"
        or (value.startswith("custom:") and _URL_RE.match(value.removeprefix("custom:")))
        or _SPDX_RE.match(value)
    ):
        return (
            f"is {value!r}, not an SPDX id, 'proprietary' or 'custom:<url>'",
            '"licence": "MIT" (an id from https://spdx.org/licenses/), or "custom:https://..."',
        )
    if name == "citation" and not (_DOI_RE.match(value) or _ARXIV_RE.match(value)):
        return (
            f"is {value!r}, neither a DOI nor an arXiv id",
            '"citation": "10.1038/s42256-023-00716-3" or "arXiv:2401.00096"',
        )
    return None


def read_checkpoint_info(
    table: Any,
    line: int,
    key_lines: dict[str, int],
    declared: dict[str, str | None],
    problem: Report,
    warning: Report,
    inner_lines: dict[str, dict[str, int]] | None = None,
) -> dict[str, CheckpointInfo]:
    """The valid ``{id: CheckpointInfo}`` entries of ``CHECKPOINT_INFO``.

    An id ``CHECKPOINTS`` does not declare, a value that is not a dict and a field
    of the wrong type are problems; a field this version does not know is a
    ``warning`` (a newer rootstock may know it), and is left out of the result.
    """
    if not isinstance(table, dict):
        problem(
            line,
            "CHECKPOINT_INFO must be a dict {checkpoint-id: {field: value}}",
            f"write {CHECKPOINT_INFO_EXAMPLE}",
        )
        return {}
    infos: dict[str, CheckpointInfo] = {}
    for key, value in table.items():
        at = key_lines.get(key, line) if isinstance(key, str) else line
        if key not in declared:
            problem(
                at,
                f"CHECKPOINT_INFO describes {key!r}, an id CHECKPOINTS does not declare",
                "use a declared checkpoint id as the key, or remove the entry",
            )
            continue
        if not isinstance(value, dict):
            problem(
                at,
                f"CHECKPOINT_INFO[{key!r}] must be a dict {{field: value}}",
                f'write "{key}": {{"licence": "MIT"}}',
            )
            continue
        info: dict[str, Any] = {}
        for name, field_value in value.items():
            here = (inner_lines or {}).get(key, {}).get(name, at)
            if name not in CHECKPOINT_INFO_FIELDS:
                warning(
                    here,
                    f"CHECKPOINT_INFO[{key!r}] has an unknown field {name!r}; it is ignored",
                    f"use only {', '.join(CHECKPOINT_INFO_FIELDS)} (docs/environments.md)",
                )
                continue
            wrong = _info_value_problem(name, field_value)
            if wrong is not None:
                problem(here, f"CHECKPOINT_INFO[{key!r}][{name!r}] {wrong[0]}", f"write {wrong[1]}")
                continue
            info[name] = field_value
        infos[key] = cast(CheckpointInfo, info)
    return infos
