"""Environment files: a PEP 723 block plus literal tables, read with ``ast``.

An env file is never imported by the client. Its dependencies come from the
``# /// script`` block; ``CHECKPOINTS``, ``VERIFY_KWARGS``, ``VERIFY_CHECKS``, ``CLUSTERS``,
``VERIFY_STRUCTURE`` and ``CHECKPOINT_INFO`` are literal module-level assignments; ``setup``,
``setup_from_path``, ``download`` and ``evaluate_batch`` are detected as top-level
functions.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import EnvFileError
from rootstock.install.envhooks import EVALUATE_BATCH, check_evaluate_batch
from rootstock.install.envtables import (
    CHECKPOINT_ID_RE,
    CUSTOM_SUFFIX,
    SETUP_FROM_PATH_SIGNATURE,
    CheckpointInfo,
    Report,
    is_custom_id,
    read_checkpoint_info,
    read_checkpoints,
    read_clusters,
    read_verify_checks,
    read_verify_kwargs,
    read_verify_structure,
)
from rootstock.install.parsing import ParseProblem, loads_toml

__all__ = [
    "CHECKPOINT_ID_RE",
    "CUSTOM_SUFFIX",
    "ENV_NAME_RE",
    "CheckpointInfo",
    "EnvFile",
    "LintProblem",
    "id_conflicts",
    "is_custom_id",
    "parse_env_file",
    "read_env_file",
    "source_hash",
]

ENV_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PEP723_RE = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")
_SCRIPT_OPEN_RE = re.compile(r"(?m)^# /// script\s*$")
_REQUIREMENT_NAME_RE = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")
TABLES = (
    "CHECKPOINTS",
    "VERIFY_KWARGS",
    "VERIFY_CHECKS",
    "CLUSTERS",
    "VERIFY_STRUCTURE",
    "CHECKPOINT_INFO",
)
_MUTATING_METHODS = frozenset(
    {"update", "pop", "popitem", "setdefault", "clear", "append", "extend", "insert", "remove"}
)
SETUP_SIGNATURE = 'def setup(checkpoint, device="cuda", **kw)'


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
    # {checkpoint: {quantity: mode}}: how verification judges forces/stress/energy.
    verify_checks: dict[str, dict[str, str]] = field(default_factory=dict)
    clusters: list[str] | None = None
    verify_structure: dict[str, Any] | None = None
    # {checkpoint: CheckpointInfo}: licence, gating, source, citation, training data.
    checkpoint_info: dict[str, CheckpointInfo] = field(default_factory=dict)
    # What the lint noticed but does not refuse (an unknown CHECKPOINT_INFO field).
    warnings: list[LintProblem] = field(default_factory=list)
    functions: set[str] = field(default_factory=set)
    table_lines: dict[str, int] = field(default_factory=dict)
    id_lines: dict[str, int] = field(default_factory=dict)

    @property
    def is_variant(self) -> bool:
        """True for a ``CLUSTERS`` variant, which wins on the clusters it lists."""
        return self.clusters is not None

    @property
    def has_setup_from_path(self) -> bool:
        return "setup_from_path" in self.functions

    @property
    def has_evaluate_batch(self) -> bool:
        """True when the env batches natively (the worker loops in-process otherwise)."""
        return EVALUATE_BATCH in self.functions

    @property
    def has_download(self) -> bool:
        return "download" in self.functions

    @property
    def source_hash(self) -> str:
        return source_hash(self.source)

    def declared_ids(self) -> list[str]:
        return list(self.checkpoints)

    def gated_url(self, checkpoint: str) -> str | None:
        """Where access to ``checkpoint``'s gated weights is requested; None if not gated."""
        return self.checkpoint_info.get(checkpoint, {}).get("gated")

    def line_of(self, checkpoint: str) -> int:
        """The line that declares ``checkpoint`` (the table's line if unknown)."""
        return self.id_lines.get(checkpoint, self.table_lines.get("CHECKPOINTS", 1))


def source_hash(text: str) -> str:
    """The hash recorded in the manifest to notice hotfixes of ``env_source.py``."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


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
        raise EnvFileError(
            f"cannot read env file {path}: {exc}",
            hint="check the path and permissions, and save the file as UTF-8",
        ) from None
    env = EnvFile(path=path, name=name or path.stem, source=source)
    problems: list[LintProblem] = []

    def problem(line: int, message: str, fix: str) -> None:
        problems.append(LintProblem(path, line, message, fix))

    def warning(line: int, message: str, fix: str) -> None:
        env.warnings.append(LintProblem(path, line, message, fix))

    if not ENV_NAME_RE.match(env.name):
        problem(
            1,
            f"env name {env.name!r} (from the file name) is not allowed",
            "rename the file to letters, digits, '.', '_' or '-', e.g. my-model.py",
        )

    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        problem(
            exc.lineno or 1,
            f"syntax error: {exc.msg}",
            "make the file valid Python (python -m py_compile FILE)",
        )
        return env, problems

    _read_script_block(env, problem)
    _read_module(env, tree, problem, warning)
    return env, problems


def _read_script_block(env: EnvFile, problem: Report) -> None:
    blocks = [m for m in _PEP723_RE.finditer(env.source) if m.group("type") == "script"]
    opening = _SCRIPT_OPEN_RE.search(env.source)
    if not blocks and opening:
        problem(
            env.source.count("\n", 0, opening.start()) + 1,
            "the '# /// script' block is never closed, or has a line not starting with '#'",
            "end it with a line '# ///', and start every line inside it with '# '",
        )
        return
    if not blocks:
        problem(
            1,
            "no PEP 723 metadata block ('# /// script' ... '# ///')",
            "add a '# /// script' block with requires-python and dependencies",
        )
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
        meta = loads_toml(content)
    except ParseProblem as exc:
        problem(
            line,
            f"the '# /// script' block cannot be read: {exc}",
            "fix the TOML inside the block (each line starts with '# ')",
        )
        return
    env.script_metadata = meta
    deps = meta.get("dependencies")
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        problem(
            line,
            "the '# /// script' block needs dependencies = [\"pkg\", ...]",
            'list the model\'s packages, e.g. dependencies = ["ase", "torch"]',
        )
    else:
        env.dependencies = deps
        for dep in deps:
            found = _REQUIREMENT_NAME_RE.match(dep)
            if found and re.sub(r"[-_.]+", "-", found.group(1)).lower() == "rootstock":
                problem(
                    line,
                    f"dependency {dep!r}: rootstock is not installed by name "
                    "(a different public package on PyPI is also called rootstock)",
                    "remove it; every env gets this rootstock's own wheel automatically",
                )
    rp = meta.get("requires-python")
    if rp is not None and not isinstance(rp, str):
        problem(line, "requires-python must be a string", 'write e.g. requires-python = ">=3.11"')
    else:
        env.requires_python = rp


def _read_module(env: EnvFile, tree: ast.Module, problem: Report, warning: Report) -> None:
    values: dict[str, tuple[int, Any]] = {}
    nodes: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            env.functions.add(node.name)
            if node.name == "setup":
                _check_signature(node, "checkpoint", SETUP_SIGNATURE, problem)
            elif node.name == "setup_from_path":
                _check_signature(node, "path", SETUP_FROM_PATH_SIGNATURE, problem)
            elif node.name == EVALUATE_BATCH:
                check_evaluate_batch(node, problem)
            continue
        target, value = _simple_assignment(node)
        if target not in TABLES or value is None:
            continue
        if target in env.table_lines:
            problem(
                node.lineno,
                f"{target} is assigned again (first on line {env.table_lines[target]})",
                f"keep one {target} = {{...}}; the client reads only one literal",
            )
            continue
        env.table_lines[target] = node.lineno
        try:
            values[target] = (node.lineno, ast.literal_eval(value))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            problem(
                node.lineno,
                f"{target} is not a literal",
                f"write {target} as a plain literal (no names, calls or comprehensions)",
            )
            continue
        nodes[target] = value
        if isinstance(value, ast.Dict):
            _check_duplicate_keys(target, value, problem)
    _check_tables_not_changed(env, tree, problem)

    if "setup" not in env.functions:
        problem(
            1,
            "no top-level setup() function",
            f"define {SETUP_SIGNATURE} returning an ASE calculator",
        )
    if "CHECKPOINTS" not in values:
        if "CHECKPOINTS" not in env.table_lines:
            problem(
                1,
                "no module-level CHECKPOINTS table",
                'add CHECKPOINTS = {"my-model-1": "upstream-name"}',
            )
        return
    env.id_lines = _key_lines(nodes["CHECKPOINTS"])
    line, table = values["CHECKPOINTS"]
    env.checkpoints = read_checkpoints(table, line, env.id_lines, env.has_setup_from_path, problem)
    if "VERIFY_KWARGS" in values:
        line, table = values["VERIFY_KWARGS"]
        key_lines = _key_lines(nodes["VERIFY_KWARGS"])
        env.verify_kwargs = read_verify_kwargs(table, line, key_lines, env.checkpoints, problem)
    if "VERIFY_CHECKS" in values:
        line, table = values["VERIFY_CHECKS"]
        checks_node = nodes["VERIFY_CHECKS"]
        env.verify_checks = read_verify_checks(
            table,
            line,
            _key_lines(checks_node),
            env.checkpoints,
            problem,
            _nested_key_lines(checks_node),
        )
    if "CLUSTERS" in values:
        line, table = values["CLUSTERS"]
        env.clusters = read_clusters(table, line, problem)
    if "VERIFY_STRUCTURE" in values:
        line, table = values["VERIFY_STRUCTURE"]
        env.verify_structure = read_verify_structure(table, line, problem)
    if "CHECKPOINT_INFO" in values:
        line, table = values["CHECKPOINT_INFO"]
        info_node = nodes["CHECKPOINT_INFO"]
        env.checkpoint_info = read_checkpoint_info(
            table,
            line,
            _key_lines(info_node),
            env.checkpoints,
            problem,
            warning,
            _nested_key_lines(info_node),
        )


def _simple_assignment(node: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        if isinstance(target, ast.Name):
            return target.id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
        return node.target.id, node.value
    return None, None


def _key_lines(value: ast.expr) -> dict[str, int]:
    """Line of each string key of a dict literal, so problems point at the entry."""
    if not isinstance(value, ast.Dict):
        return {}
    return {
        key.value: key.lineno
        for key in value.keys
        if isinstance(key, ast.Constant) and isinstance(key.value, str)
    }


def _nested_key_lines(value: ast.expr) -> dict[str, dict[str, int]]:
    """Line of each string key one level down (``{"id": {"forces": ...}}``)."""
    if not isinstance(value, ast.Dict):
        return {}
    return {
        key.value: _key_lines(inner)
        for key, inner in zip(value.keys, value.values, strict=True)
        if isinstance(key, ast.Constant) and isinstance(key.value, str)
    }


def _module_level_statements(tree: ast.Module) -> list[ast.AST]:
    """Every node that runs at import time, outside function and class bodies."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        found.append(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def _tables_assigned(node: ast.stmt) -> list[tuple[str, bool]]:
    """``(table, rebinds)`` for each table a statement assigns, changes or deletes.

    ``rebinds`` is True when the whole name is bound (``CHECKPOINTS = ...``) and
    False for item assignment, augmented assignment and ``del``.
    """
    if isinstance(node, ast.Assign | ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    else:
        return []
    binds = isinstance(node, ast.Assign | ast.AnnAssign)
    return [
        (sub.id, binds and sub is target)
        for target in targets
        for sub in ast.walk(target)
        if isinstance(sub, ast.Name) and sub.id in TABLES
    ]


def _check_tables_not_changed(env: EnvFile, tree: ast.Module, problem: Report) -> None:
    """Reject tables the worker would see differently from the client.

    The client reads one top-level literal; an import-time edit, or a definition
    inside ``if``/``try``, would make the two sides of the socket disagree.
    """
    top_level = {id(node) for node in tree.body}
    reported: set[tuple[str, int]] = set()

    def report(name: str, line: int, message: str, fix: str) -> None:
        if (name, line) not in reported:
            reported.add((name, line))
            problem(line, message, fix)

    for node in _module_level_statements(tree):
        # Only statements (assignment, augmented assignment, del) change a table.
        if isinstance(node, ast.stmt):
            for name, rebinds in _tables_assigned(node):
                if rebinds and id(node) in top_level:
                    continue  # the one literal definition, read by _read_module
                if rebinds:
                    message = f"{name} is defined inside a block (if/try/for/with)"
                else:
                    message = f"{name} is changed after its top-level literal"
                report(
                    name,
                    node.lineno,
                    message,
                    f"put every entry in the one top-level {name} = ... literal",
                )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in TABLES
            and node.func.attr in _MUTATING_METHODS
        ):
            name = node.func.value.id
            report(
                name,
                node.lineno,
                f"{name}.{node.func.attr}() changes {name} at import time",
                f"put every entry in the one top-level {name} = ... literal",
            )


def _check_signature(
    node: ast.FunctionDef | ast.AsyncFunctionDef, first: str, signature: str, problem: Report
) -> None:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    if not positional and not args.vararg:
        problem(
            node.lineno, f"{node.name}() takes no {first} argument", f"declare it as {signature}"
        )
    names = {a.arg for a in [*positional, *args.kwonlyargs]}
    if "device" not in names and args.kwarg is None:
        problem(
            node.lineno, f"{node.name}() accepts no device argument", f"declare it as {signature}"
        )


def _check_duplicate_keys(target: str, value: ast.Dict, problem: Report) -> None:
    seen: set[Any] = set()
    for key in value.keys:
        if isinstance(key, ast.Constant):
            if key.value in seen:
                problem(
                    key.lineno,
                    f"{target} repeats the key {key.value!r}",
                    "remove the duplicate entry; Python would silently keep the last one",
                )
            seen.add(key.value)


def id_conflicts(new: EnvFile, installed: list[EnvFile]) -> list[LintProblem]:
    """Checkpoint ids in ``new`` that another installed env already declares.

    Two universal envs may not share an id; a ``CLUSTERS`` variant may shadow a
    universal id (it wins on the clusters it lists), but two variants may not
    share an id on a common cluster.
    """
    problems = []
    for other in installed:
        if other.name == new.name:
            continue
        for cid in sorted(set(new.checkpoints) & set(other.checkpoints)):
            if new.is_variant != other.is_variant:
                continue
            if new.is_variant:
                shared = sorted(set(new.clusters or []) & set(other.clusters or []))
                if not shared:
                    continue
                message = (
                    f"checkpoint id {cid!r} is already declared by the installed "
                    f"variant {other.name!r} for cluster(s) {', '.join(shared)}"
                )
                fix = (
                    f"drop {', '.join(shared)} from the CLUSTERS of one of the two "
                    "variants, or rename the id"
                )
            else:
                message = (
                    f"checkpoint id {cid!r} is already declared by the installed env {other.name!r}"
                )
                fix = (
                    "rename the id, or make this file a CLUSTERS variant for the "
                    "clusters where it should win"
                )
            problems.append(LintProblem(new.path, new.line_of(cid), message, fix))
    return problems
