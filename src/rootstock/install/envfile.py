"""Environment files: a PEP 723 block plus literal tables, read with ``ast``.

An env file is never imported by the client. Its dependencies come from the
``# /// script`` block; ``CHECKPOINTS``, ``VERIFY_KWARGS``, ``CLUSTERS`` and
``VERIFY_STRUCTURE`` are literal module-level assignments; ``setup``,
``setup_from_path`` and ``download`` are detected as top-level functions.
"""

from __future__ import annotations

import ast
import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import EnvFileError

ENV_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
CHECKPOINT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?::custom)?$")
CUSTOM_SUFFIX = ":custom"
_PEP723_RE = re.compile(
    r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$"
)
TABLES = ("CHECKPOINTS", "VERIFY_KWARGS", "CLUSTERS", "VERIFY_STRUCTURE")


@dataclass(frozen=True)
class LintProblem:
    """One thing wrong with an env file, with where and how to fix it."""

    path: Path
    line: int
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message} (fix: {self.fix})"


@dataclass
class EnvFile:
    """What the client knows about an env file without importing it."""

    path: Path
    name: str
    source: str
    requires_python: str | None = None
    dependencies: list[str] = field(default_factory=list)
    script_metadata: dict[str, Any] = field(default_factory=dict)
    checkpoints: dict[str, str | None] = field(default_factory=dict)
    verify_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    clusters: list[str] | None = None
    verify_structure: dict[str, Any] | None = None
    functions: set[str] = field(default_factory=set)
    table_lines: dict[str, int] = field(default_factory=dict)

    @property
    def is_variant(self) -> bool:
        """True for a ``CLUSTERS`` variant, which wins on the clusters it lists."""
        return self.clusters is not None

    @property
    def has_setup_from_path(self) -> bool:
        return "setup_from_path" in self.functions

    @property
    def has_download(self) -> bool:
        return "download" in self.functions

    @property
    def source_hash(self) -> str:
        return source_hash(self.source)

    def declared_ids(self) -> list[str]:
        return list(self.checkpoints)


def source_hash(text: str) -> str:
    """The hash recorded in the manifest to notice hotfixes of ``env_source.py``."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_custom_id(checkpoint: str) -> bool:
    """True for ``<family>:custom`` ids, which take user-supplied weights."""
    return checkpoint.endswith(CUSTOM_SUFFIX)


def read_env_file(path: Path, name: str | None = None) -> EnvFile:
    """Parse ``path`` and lint it on its own; raise :class:`EnvFileError` on problems.

    ``name`` is the env name; it defaults to the file's stem (``env_source.py`` is
    read by the env directory's name, which the caller passes).
    """
    env, problems = parse_env_file(path, name)
    if problems:
        raise EnvFileError(
            f"{path} is not a valid rootstock environment file "
            f"({len(problems)} problem{'s' if len(problems) > 1 else ''})",
            problems,
            hint="see docs/environments.md for the env-file format",
        )
    return env


def parse_env_file(path: Path, name: str | None = None) -> tuple[EnvFile, list[LintProblem]]:
    """Parse ``path`` into an :class:`EnvFile` and the problems found on its own."""
    path = Path(path)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvFileError(f"cannot read env file {path}: {exc}") from None
    env = EnvFile(path=path, name=name or path.stem, source=source)
    problems: list[LintProblem] = []

    def problem(line: int, message: str, fix: str) -> None:
        problems.append(LintProblem(path, line, message, fix))

    if not ENV_NAME_RE.match(env.name):
        problem(1, f"env name {env.name!r} (from the file name) is not allowed",
                "rename the file to letters, digits, '.', '_' or '-', e.g. my-model.py")

    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        problem(exc.lineno or 1, f"syntax error: {exc.msg}",
                "make the file valid Python (python -m py_compile FILE)")
        return env, problems

    _read_script_block(env, problem)
    _read_module(env, tree, problem)
    return env, problems


def _read_script_block(env: EnvFile, problem) -> None:
    blocks = [m for m in _PEP723_RE.finditer(env.source) if m.group("type") == "script"]
    if not blocks:
        problem(1, "no PEP 723 metadata block ('# /// script' ... '# ///')",
                "add a '# /// script' block with requires-python and dependencies")
        return
    if len(blocks) > 1:
        line = env.source.count("\n", 0, blocks[1].start()) + 1
        problem(line, "more than one '# /// script' block", "keep exactly one block")
        return
    block = blocks[0]
    line = env.source.count("\n", 0, block.start()) + 1
    content = "".join(
        row[2:] if row.startswith("# ") else row[1:]
        for row in block.group("content").splitlines(keepends=True)
    )
    try:
        meta = tomllib.loads(content)
    except tomllib.TOMLDecodeError as exc:
        problem(line, f"the '# /// script' block is not valid TOML: {exc}",
                "fix the TOML inside the block (each line starts with '# ')")
        return
    env.script_metadata = meta
    deps = meta.get("dependencies")
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        problem(line, "the '# /// script' block needs dependencies = [\"pkg\", ...]",
                "list the model's packages, e.g. dependencies = [\"ase\", \"torch\"]")
    else:
        env.dependencies = deps
    rp = meta.get("requires-python")
    if rp is not None and not isinstance(rp, str):
        problem(line, "requires-python must be a string", 'write e.g. requires-python = ">=3.11"')
    else:
        env.requires_python = rp


def _read_module(env: EnvFile, tree: ast.Module, problem) -> None:
    values: dict[str, tuple[int, Any]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            env.functions.add(node.name)
            if node.name == "setup":
                _check_setup_signature(node, problem)
            continue
        target, value = _simple_assignment(node)
        if target not in TABLES:
            continue
        env.table_lines[target] = node.lineno
        try:
            values[target] = (node.lineno, ast.literal_eval(value))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            problem(node.lineno, f"{target} is not a literal",
                    f"write {target} as a plain literal (no names, calls or comprehensions)")
            continue
        if isinstance(value, ast.Dict):
            _check_duplicate_keys(target, value, problem)

    if "setup" not in env.functions:
        problem(1, "no top-level setup(checkpoint, device=\"cuda\", **kw) function",
                "define setup() returning an ASE calculator for the checkpoint")
    if "CHECKPOINTS" not in values:
        if "CHECKPOINTS" not in env.table_lines:
            problem(1, "no module-level CHECKPOINTS table",
                    "add CHECKPOINTS = {\"my-model-1\": \"upstream-name\"}")
        return
    _read_checkpoints(env, *values["CHECKPOINTS"], problem)
    if "VERIFY_KWARGS" in values:
        _read_verify_kwargs(env, *values["VERIFY_KWARGS"], problem)
    if "CLUSTERS" in values:
        _read_clusters(env, *values["CLUSTERS"], problem)
    if "VERIFY_STRUCTURE" in values:
        _read_verify_structure(env, *values["VERIFY_STRUCTURE"], problem)


def _simple_assignment(node: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        if isinstance(target, ast.Name):
            return target.id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
        return node.target.id, node.value
    return None, None


def _check_setup_signature(node: ast.FunctionDef | ast.AsyncFunctionDef, problem) -> None:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    if not positional and not args.vararg:
        problem(node.lineno, "setup() takes no checkpoint argument",
                "declare it as def setup(checkpoint, device=\"cuda\", **kw)")
    names = {a.arg for a in [*positional, *args.kwonlyargs]}
    if "device" not in names and args.kwarg is None:
        problem(node.lineno, "setup() accepts no device argument",
                "declare it as def setup(checkpoint, device=\"cuda\", **kw)")


def _check_duplicate_keys(target: str, value: ast.Dict, problem) -> None:
    seen: set[Any] = set()
    for key in value.keys:
        if isinstance(key, ast.Constant):
            if key.value in seen:
                problem(key.lineno, f"{target} repeats the key {key.value!r}",
                        "remove the duplicate entry; Python would silently keep the last one")
            seen.add(key.value)


def _read_checkpoints(env: EnvFile, line: int, table: Any, problem) -> None:
    if not isinstance(table, dict) or not table:
        problem(line, "CHECKPOINTS must be a non-empty dict {id: upstream-string}",
                "write CHECKPOINTS = {\"my-model-1\": \"upstream-name\"}")
        return
    for key, value in table.items():
        if not isinstance(key, str) or not CHECKPOINT_ID_RE.match(key):
            problem(line, f"checkpoint id {key!r} is not allowed",
                    "use [A-Za-z0-9][A-Za-z0-9._-]*, or <family>:custom")
            continue
        if is_custom_id(key):
            if value is not None and not isinstance(value, str):
                problem(line, f"CHECKPOINTS[{key!r}] must be None or a string",
                        f"write \"{key}\": None")
                continue
            if not env.has_setup_from_path:
                problem(line, f"{key!r} takes user weights but there is no setup_from_path()",
                        "define setup_from_path(path, device=\"cuda\", **kw), or drop the entry")
        elif not isinstance(value, str):
            problem(line, f"CHECKPOINTS[{key!r}] is {value!r}; it must be a string",
                    "give the upstream name or path; None is allowed only for <family>:custom")
            continue
        env.checkpoints[key] = value


def _read_verify_kwargs(env: EnvFile, line: int, table: Any, problem) -> None:
    if not isinstance(table, dict):
        problem(line, "VERIFY_KWARGS must be a dict {checkpoint-id: {kwarg: value}}",
                "write VERIFY_KWARGS = {\"my-model-1\": {\"task\": \"omat\"}}")
        return
    for key, value in table.items():
        if key not in env.checkpoints:
            problem(line, f"VERIFY_KWARGS names {key!r}, which CHECKPOINTS does not declare",
                    "use a declared checkpoint id as the key, or remove the entry")
            continue
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            problem(line, f"VERIFY_KWARGS[{key!r}] must be a dict of keyword arguments",
                    f"write \"{key}\": {{\"name\": value}}")
            continue
        env.verify_kwargs[key] = value


def _read_clusters(env: EnvFile, line: int, table: Any, problem) -> None:
    if not isinstance(table, list | tuple) or not all(isinstance(c, str) and c for c in table):
        problem(line, "CLUSTERS must be a list of cluster names",
                "write CLUSTERS = [\"della\"]")
        return
    if not table:
        problem(line, "CLUSTERS is empty, so this variant would apply nowhere",
                "list the clusters it is for, or delete CLUSTERS to make it universal")
        return
    env.clusters = [c.lower() for c in table]


def _read_verify_structure(env: EnvFile, line: int, table: Any, problem) -> None:
    if not isinstance(table, dict):
        problem(line, "VERIFY_STRUCTURE must be a dict with symbols and positions",
                "see docs/environments.md#verify_structure")
        return
    symbols, positions = table.get("symbols"), table.get("positions")
    ok = (
        isinstance(symbols, list | tuple | str)
        and isinstance(positions, list | tuple)
        and all(isinstance(p, list | tuple) and len(p) == 3 for p in positions)
    )
    if ok and not isinstance(symbols, str):
        ok = len(symbols) == len(positions)
    cell = table.get("cell")
    if cell is not None and not (isinstance(cell, list | tuple) and len(cell) == 3):
        ok = False
    if not ok:
        problem(line, "VERIFY_STRUCTURE needs symbols, positions (N x 3) and optionally "
                "cell (3 x 3) and pbc", "see docs/environments.md#verify_structure")
        return
    env.verify_structure = table


def id_conflicts(new: EnvFile, installed: list[EnvFile]) -> list[LintProblem]:
    """Checkpoint ids in ``new`` that another installed env already declares.

    Two universal envs may not share an id; a ``CLUSTERS`` variant may shadow a
    universal id, but two variants may not share an id on a common cluster.
    """
    problems = []
    line = new.table_lines.get("CHECKPOINTS", 1)
    for other in installed:
        if other.name == new.name:
            continue
        for cid in sorted(set(new.checkpoints) & set(other.checkpoints)):
            if new.is_variant != other.is_variant:
                continue
            if new.is_variant and not set(new.clusters or []) & set(other.clusters or []):
                continue
            where = "" if not new.is_variant else " on the same cluster"
            problems.append(LintProblem(
                new.path, line,
                f"checkpoint id {cid!r} is already declared by the installed env "
                f"{other.name!r}{where}",
                "rename the id, or make this file a CLUSTERS variant for specific clusters",
            ))
    return problems
