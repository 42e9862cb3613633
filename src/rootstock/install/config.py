"""The user's ``~/.config/rootstock/config.toml``.

It holds the default root and, for maintainers, the dashboard credentials, so it
is always written with mode 0600.

What is read is checked like what is written: a known key of the wrong type is a
:class:`~rootstock.errors.ConfigError` naming the file and the key, never a value
quietly coerced (``root = 5`` once became ``<cwd>/5``). Keys rootstock does not
know are kept as they are; their readers (``push_timeout``, ...) check them.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
from pathlib import Path
from typing import Any

from rootstock import names
from rootstock.errors import ConfigError, UsageError
from rootstock.install.atomic import atomic_write_text
from rootstock.install.parsing import (
    SMALL_FILE_MAX_BYTES,
    ParseProblem,
    absolute_path_problem,
    loads_toml,
    read_regular_file,
    type_name,
)

CONFIG_ENV = "ROOTSTOCK_CONFIG"
CONFIG_KEYS = (
    "root",
    "cluster",
    "maintainer_name",
    "maintainer_email",
    "is_maintainer",
    "api_url",
    "api_key",
    "api_secret",
    "stage",
)
#: The values of ``stage``: how workers are staged on their node (docs/cold-start.md).
STAGE_MODES = ("auto", "mount", "copy", "off")
# The keys that hold text. ``root`` and ``cluster`` are text with rules of their own.
STRING_KEYS = ("maintainer_name", "maintainer_email", "api_url", "api_key", "api_secret")
BOOLEAN_KEYS = ("is_maintainer",)

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_REINIT_HINT = "or move the file aside and re-run `rootstock init`"


def config_path() -> Path:
    """Where config.toml lives: ``$ROOTSTOCK_CONFIG``, else the XDG config dir."""
    override = os.environ.get(CONFIG_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "rootstock" / "config.toml"


def config_problem(key: str, value: Any) -> str | None:
    """Why ``value`` is not acceptable for the known key ``key``, or None.

    Keys rootstock does not know are never a problem here. A ``cluster`` that is
    text but breaks the name rule is not a problem on read either (see
    :func:`load_config`), only its type is.
    """
    if key == "root":
        return absolute_path_problem(value, expand_home=True)
    if key == "cluster" and not isinstance(value, str):
        return f"must be a cluster name string, not {type_name(value)}"
    if key in STRING_KEYS and not isinstance(value, str):
        return f"must be a string, not {type_name(value)}"
    if key in STRING_KEYS and "\0" in value:
        return "must not contain a NUL character"
    if key in BOOLEAN_KEYS and not isinstance(value, bool):
        return f"must be true or false, not {type_name(value)}"
    if key == "stage" and not (isinstance(value, str) and value.strip().lower() in STAGE_MODES):
        shown = repr(value) if isinstance(value, str) else type_name(value)
        return f"must be one of {', '.join(STAGE_MODES)}, not {shown}"
    return None


def load_config() -> dict[str, Any]:
    """Read config.toml; a missing file is an empty config.

    Raises :class:`ConfigError` naming the file (and the key, for a value of the
    wrong type) for a file that is not a regular file or is over
    :data:`~rootstock.install.parsing.SMALL_FILE_MAX_BYTES`, and for text that is
    not UTF-8, not TOML, nested too deep, or holds a known key of the wrong type.
    A ``cluster`` that today's name rule refuses is kept and warned about
    (:class:`~rootstock.names.StoredNameWarning`), so the install stays usable;
    :func:`save_config` refuses to write it again.
    """
    path = config_path()
    try:
        raw = read_regular_file(path, SMALL_FILE_MAX_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(
            f"cannot read {path}: {exc.strerror or exc}",
            hint=f"check the file's permissions, {_REINIT_HINT}",
        ) from None
    except ParseProblem as exc:
        raise ConfigError(
            f"cannot read {path}: {exc}",
            hint=f"check that {path} is the config file you meant ({CONFIG_ENV} names "
            f"another), {_REINIT_HINT}",
        ) from None
    try:
        data = loads_toml(raw)
    except ParseProblem as exc:
        raise ConfigError(
            f"{path} is not a valid config file: {exc}",
            hint=f"fix the file by hand (it is TOML, UTF-8), {_REINIT_HINT}",
        ) from None
    for key in CONFIG_KEYS:
        if key not in data:
            continue
        problem = config_problem(key, data[key])
        if problem:
            raise ConfigError(
                f"{path}: {key} {problem}",
                hint=f"edit {key} in {path} ({_key_form(key)}), {_REINIT_HINT}",
            )
    if "cluster" in data:
        data["cluster"] = _stored_cluster(data["cluster"], path)
    return data


def _stored_cluster(value: str, path: Path) -> str:
    """The configured cluster, normalised; an invalid one is kept, with a warning."""
    try:
        return names.cluster_name(value)
    except UsageError:
        names.warn_stored_name(
            "cluster name",
            value,
            str(path),
            f"set a valid one ({names.CLUSTER_NAME_RULE}): edit cluster in that file, "
            "or run `rootstock init --force --root ROOT --cluster NAME`",
        )
        return value


def _key_form(key: str) -> str:
    if key == "root":
        return 'root = "/absolute/path/of/the/install"'
    if key == "cluster":
        return 'cluster = "name"'
    if key in BOOLEAN_KEYS:
        return f"{key} = true or {key} = false"
    if key == "stage":
        return 'stage = "auto" (or "mount", "copy", "off")'
    return f'{key} = "text"'


def save_config(values: dict[str, Any]) -> Path:
    """Write ``values`` to config.toml with mode 0600.

    Refuses (:class:`~rootstock.errors.UsageError`, nothing written) a value that
    :func:`load_config` would refuse, and a ``cluster`` that breaks the name rule,
    so rootstock never writes a config it cannot read back.
    """
    path = config_path()
    for key in CONFIG_KEYS:
        if values.get(key) is None:
            continue
        problem = config_problem(key, values[key])
        if problem:
            raise UsageError(f"refusing to write {path}: {key} {problem}")
    cluster = values.get("cluster")
    if cluster is not None and not names.is_cluster_name(cluster):
        raise UsageError(
            f"refusing to write {path}: {cluster!r} is not a valid cluster name",
            hint=f"a cluster name is {names.CLUSTER_NAME_RULE}; pass --cluster NAME",
        )
    lines = ["# Written by `rootstock init`. Holds API secrets: keep it mode 0600."]
    for key in CONFIG_KEYS:
        if values.get(key) is not None:
            lines.append(f"{_toml_key(key)} = {_toml_value(values[key])}")
    for key in sorted(set(values) - set(CONFIG_KEYS)):
        if values[key] is not None:
            lines.append(f"{_toml_key(key)} = {_toml_value(values[key])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n", mode=0o600)
    return path


def _toml_key(key: str) -> str:
    # A key read back from a hand-written file may need quotes ("a b" = 1); written
    # bare it would make the next read fail.
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_value(value: Any) -> str:
    """``value`` as a TOML value; what a config read returned writes back unchanged."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, dt.date | dt.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        inner = ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{" + inner + "}" if inner else "{}"
    return _toml_string(str(value))


def _toml_string(text: str) -> str:
    # TOML basic strings may hold no control character but tab: escape them all,
    # or a value with a carriage return would make the file unreadable.
    out = []
    for char in text:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append(char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
