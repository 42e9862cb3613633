"""Strict parsing of the JSON and TOML files (and command-line JSON) rootstock reads.

Every reader turns bad input into one exception, :class:`ParseProblem`, whose
message says what is wrong in words a user can act on; the caller wraps it in the
right :class:`~rootstock.errors.RootstockError` with the file's path and a hint.

* Text must be UTF-8.
* JSON is standard JSON: ``NaN``, ``Infinity``, ``-Infinity`` and numbers that
  overflow a float (``1e999``) are refused (Python's ``json`` accepts and writes
  them; nothing else does).
* JSON objects hold each key once. Python's ``json`` keeps the last of two equal
  keys, so a stray duplicate would silently drop the first value (and a write
  would then store the loss); it is refused instead.
* Nesting is bounded. The stdlib parsers recurse, so a file nested 100,000 deep
  raises ``RecursionError``, which is not a decode error; it is caught here and
  reported like one. A value that parsed but nests deeper than ``max_depth`` is
  refused too (:func:`check_depth`), so no later walk can recurse out of stack.

Small input files (config, registry, layout) are read by :func:`read_regular_file`:
only a regular file, never blocking on a FIFO, and only up to a cap.

Two helpers word the refusals of values the files hold: :func:`type_name` and
:func:`absolute_path_problem` (a stored path must be absolute as written).
"""

from __future__ import annotations

import json
import math
import os
import stat
import tomllib
from typing import Any

# Deeper than any file of ours legitimately nests (the manifest reaches about 9).
MAX_DEPTH = 64
# setup() keywords (``--kwarg``, ``--setup-kwargs``) nest a level or two. The manifest
# records them about 9 levels down and refuses files nested deeper than MAX_DEPTH, so
# 32 leaves room on both sides.
MAX_KWARG_DEPTH = 32
# config.toml, the cluster registry, layout.json and an env's build metadata hold a
# few hundred bytes; a file a thousand times that size is a mistake, not a setting.
SMALL_FILE_MAX_BYTES = 1 << 20


class ParseProblem(ValueError):
    """Why a text could not be parsed; the message is user-facing."""


class TooDeep(ParseProblem):
    """The text parsed, or would have, but nests deeper than the bound."""


def read_regular_file(path: str | os.PathLike[str], max_bytes: int | None) -> bytes:
    """The bytes of ``path``, refusing anything but a regular file of at most ``max_bytes``.

    Links are followed. Anything else (a FIFO, a device, a directory) is refused
    before it is opened, and the open never blocks, so a FIFO swapped in after that
    check is refused too instead of waiting for a writer. A file over ``max_bytes``
    is refused by its size before any of it is read; ``None`` means no cap. Raises
    :class:`OSError` (``FileNotFoundError`` for a missing file) or
    :class:`ParseProblem` saying what the file is or how big.
    """
    require_regular_file(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        _require_regular_mode(info.st_mode)
        if max_bytes is not None and info.st_size > max_bytes:
            raise ParseProblem(_too_large(info.st_size, max_bytes))
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if max_bytes is not None and len(raw) > max_bytes:  # it grew after the fstat
        raise ParseProblem(_too_large(len(raw), max_bytes, "or more "))
    return raw


def require_regular_file(path: str | os.PathLike[str]) -> None:
    """Raise :class:`ParseProblem` naming what ``path`` is unless it is a regular file.

    Links are followed; the ``OSError`` of a missing or unreadable path propagates.
    Reading a directory fails and reading a FIFO blocks, so a reader that opens the
    file itself checks this first.
    """
    _require_regular_mode(os.stat(path).st_mode)


def loads_json(
    raw: str | bytes, max_depth: int = MAX_DEPTH, *, walked_by_caller: bool = False
) -> Any:
    """Parse standard JSON, refusing non-UTF-8, NaN/Infinity, duplicate keys, deep nesting.

    ``walked_by_caller`` skips the two passes over every number and container
    (the float range, :func:`check_depth`), for a caller whose own walk of the
    whole value makes both: the manifest, megabytes on a large install, read by
    every ``status``. Then ``1e999`` parses as ``inf``, and nesting up to the
    interpreter's recursion limit parses.
    """
    if isinstance(raw, bytes | bytearray):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise ParseProblem("not UTF-8 text") from None
    floats = float if walked_by_caller else _finite_float
    try:
        value = json.loads(
            raw,
            parse_constant=_refuse_constant,
            parse_float=floats,
            object_pairs_hook=_object_with_unique_keys,
        )
    except RecursionError:
        raise TooDeep(_too_deep(max_depth)) from None
    except json.JSONDecodeError as exc:
        raise ParseProblem(
            f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except ParseProblem:
        raise
    except ValueError:  # an integer past int's 4300-digit limit (sys.get_int_max_str_digits)
        raise ParseProblem("invalid JSON (a number with too many digits)") from None
    if not walked_by_caller:
        check_depth(value, max_depth)
    return value


def loads_toml(raw: str | bytes, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """Parse TOML, refusing non-UTF-8 and deep nesting."""
    if isinstance(raw, bytes | bytearray):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise ParseProblem("not UTF-8 text") from None
    try:
        value = tomllib.loads(raw)
    except RecursionError:
        raise TooDeep(_too_deep(max_depth)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ParseProblem(f"invalid TOML ({exc})") from None
    except ValueError:  # an integer past int's 4300-digit limit (sys.get_int_max_str_digits)
        raise ParseProblem("invalid TOML (a number with too many digits)") from None
    check_depth(value, max_depth)
    return value


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`ParseProblem` if ``value`` nests lists/dicts deeper than ``max_depth``.

    Raises :class:`TooDeep`. Iterative, so it cannot itself run out of stack.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise TooDeep(_too_deep(max_depth))
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def dumps_json(value: Any, **options: Any) -> str:
    """``json.dumps`` that refuses NaN and infinities instead of writing non-standard JSON.

    Raises :class:`ParseProblem` naming the problem.
    """
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError as exc:
        raise ParseProblem(f"cannot be written as standard JSON: {exc}") from None


def absolute_path_problem(value: object, expand_home: bool = False) -> str | None:
    """Why ``value`` cannot be a stored absolute path, or None if it can.

    A stored path must be a non-empty string without NUL that is absolute as
    written: a relative one would mean something different in every working
    directory. ``expand_home`` allows a leading ``~`` (the user's own files only:
    in a shared file it would name a different home for every user).
    """
    if not isinstance(value, str):
        return f"must be a path string, not {type_name(value)}"
    if not value.strip():
        return "must be a path, not an empty string"
    if "\0" in value:
        return "must not contain a NUL character"
    written = os.path.expanduser(value) if expand_home else value
    if not os.path.isabs(written):
        return f"must be an absolute path, not {value!r}"
    return None


def type_name(value: object) -> str:
    """The TOML/JSON name of ``value``'s type, for messages (never the value: it may be secret)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def _object_with_unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Called for every object of a megabyte manifest, so the common case is one dict
    # build and one length test, both in C; only a refusal looks for the culprit.
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ParseProblem(
                    f"duplicate key {json.dumps(key)} in one object (JSON readers "
                    "disagree on which value counts, so rootstock reads neither)"
                )
            seen.add(key)
    return value


def _require_regular_mode(mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise ParseProblem(f"it is {_file_kind(mode)}, not a regular file")


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def _too_large(size: int, max_bytes: int, more: str = "") -> str:
    return f"it is {size:,} bytes {more}long; rootstock reads at most {max_bytes:,} bytes of it"


def _refuse_constant(name: str) -> Any:
    raise ParseProblem(f"{name} is not standard JSON (only finite numbers are)")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e999 parses as inf
        raise ParseProblem(f"{text} is out of range for a number")
    return number


def _too_deep(max_depth: int) -> str:
    return f"nested deeper than {max_depth} levels"


# --- files someone else could have swapped -------------------------------------------


class NotRegularFile(ParseProblem):
    """A path that holds something other than a regular file: a FIFO, a link, a directory.

    ``kind`` says what it is and ``fix`` is the command that clears it.
    """

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(f"it is {kind}, not a regular file")
        self.path = os.fspath(path)
        self.kind = kind

    @property
    def fix(self) -> str:
        """``rm PATH`` (``rm -r`` for a directory)."""
        return f"rm -r {self.path}" if self.kind == "a directory" else f"rm {self.path}"


def open_regular_file(
    path: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    mode: int = 0o600,
    *,
    follow_symlinks: bool = False,
) -> int:
    """A descriptor of ``path`` (``os.open`` ``flags``), only if it is a regular file.

    What is there is checked before the open (opening a device can act on it), the
    open never blocks (a FIFO without a writer would wait forever) nor follows a
    link unless ``follow_symlinks``, and the open file is checked again, in case the
    name was swapped in between. The descriptor is in blocking mode. Raises
    :class:`NotRegularFile`, or the ``OSError`` of the open (``FileNotFoundError``
    for a missing file without ``O_CREAT``).
    """
    try:
        _require_regular(path, os.stat(path, follow_symlinks=follow_symlinks).st_mode)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    extra = os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as exc:
        # Swapped since the stat (ELOOP, EISDIR and ENXIO say so): name what is there.
        try:
            now = os.stat(path, follow_symlinks=follow_symlinks).st_mode
        except OSError:
            raise exc from None
        _require_regular(path, now)
        raise
    try:
        _require_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _require_regular(path: str | os.PathLike[str], mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    raise NotRegularFile(path, "a symbolic link" if stat.S_ISLNK(mode) else _file_kind(mode))
