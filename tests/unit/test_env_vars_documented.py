"""Every environment variable ``src/`` reads is on ``docs/environment-variables.md``, and back.

The code is read with ``ast``, never imported. What counts as a *read*:

* ``os.environ[K]``, ``os.environ.get(K)``, ``os.environ.setdefault(K)``,
  ``K in os.environ``, ``os.getenv(K)``, and the same on a plain ``environ``: the
  name ``from os import environ`` binds, and the parameter through which a function
  takes the process environment (``real_home(environ)``,
  ``RetryPolicy.from_settings(config, environ)``), also when picked by an
  expression (``(os.environ if environ is None else environ).get(K)``);
* ``os.environ.pop(K)`` whose value is used (the worker takes its lifeline fd that
  way). A ``pop`` whose result is dropped, and ``del os.environ[K]``, only remove a
  variable: not reads;
* ``envvar=K`` in any call: click reads the variable as an option's default.

``K`` is a string literal, a module-level string constant (``ROOT_ENV =
"ROOTSTOCK_ROOT"``), a constant imported from another module under ``src/`` (``from
rootstock.wire.lifeline import LIFELINE_ENV``, followed through re-exports), or
``module.CONST``. A key that resolves to no string fails the test: the scan would
otherwise miss that variable without a word.

Not reads: an environment built for a child process (``env = dict(os.environ)``,
``{**os.environ, "LC_ALL": "C"}``, ``uv_environment``) and then written, kept or
scrubbed for that child (``env[K] = v``, ``env.pop(K)``, ``install/uv.py`` leaving
out ``UV_PYTHON``). Those are described on the page's "Set or removed for child
processes" section and not checked here. Nor are the variables the standard library
reads on its own (``Path.home()`` reading HOME, ``tempfile`` reading TMPDIR).

As a net under the scan, every string in ``src/`` that is a whole ``ROOTSTOCK_*``
name must be on the page too, so a variable read by some route the scan does not
know (a mapping handed further down) still cannot go undocumented.

The page side: the backticked names in the first column of the tables under
``## Read by rootstock``. Each ``ROOTSTOCK_*`` name there must be read somewhere in
``src/``, so the page cannot keep a variable the code has stopped reading.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PAGE = REPO / "docs" / "environment-variables.md"
READ_SECTION = "## Read by rootstock"
OURS = re.compile(r"ROOTSTOCK_[A-Z0-9_]+")
_BACKTICKED_NAME = re.compile(r"`([A-Z][A-Z0-9_]*)`")
_MAPPING_READS = {"get", "pop", "setdefault"}


@dataclass(frozen=True)
class Read:
    """One variable read at one place (``where`` is ``module:line``)."""

    name: str
    where: str


@dataclass
class Module:
    """What the scan needs of one source file."""

    name: str
    tree: ast.Module
    constants: dict[str, str] = field(default_factory=dict)
    # local name -> (module, attribute); attribute None for ``import module [as x]``
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)


@dataclass
class Scan:
    """The reads found, and the keys that could not be resolved to a name."""

    reads: list[Read] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    ours: set[str] = field(default_factory=set)  # every whole ROOTSTOCK_* string


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def load_module(name: str, source: str, *, is_package: bool = False) -> Module:
    """Parse ``source`` and collect its module-level string constants and its imports."""
    tree = ast.parse(source)
    module = Module(name, tree)
    for stmt in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            for target in targets:
                if isinstance(target, ast.Name):
                    module.constants[target.id] = value.value
    # Function-level imports count too: rootstock imports lazily to keep startup fast.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    module.imports[alias.asname] = (alias.name, None)
                else:
                    top = alias.name.partition(".")[0]
                    module.imports[top] = (top, None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(name, is_package)
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                module.imports[alias.asname or alias.name] = (base, alias.name)
    return module


class Scanner:
    """Finds the environment reads of a set of modules, resolving keys across them."""

    def __init__(self, modules: Iterable[Module]) -> None:
        self.modules = {m.name: m for m in modules}

    def constant(self, module: str, attr: str, depth: int = 0) -> str | None:
        """The string ``module.attr`` is bound to, following re-exports."""
        found = self.modules.get(module)
        if found is None or depth > 10:
            return None
        if attr in found.constants:
            return found.constants[attr]
        target = found.imports.get(attr)
        if target is not None and target[1] is not None:
            return self.constant(target[0], target[1], depth + 1)
        return None

    def key(self, module: Module, node: ast.expr) -> str | None:
        """The variable name ``node`` spells in ``module``, or None."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in module.constants:
                return module.constants[node.id]
            target = module.imports.get(node.id)
            if target is not None and target[1] is not None:
                return self.constant(target[0], target[1])
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = module.imports.get(node.value.id)
            if target is not None and target[1] is None:
                return self.constant(target[0], node.attr)
        return None

    def scan(self) -> Scan:
        """Every read in every module."""
        result = Scan()
        for module in self.modules.values():
            self._scan_module(module, result)
        return result

    def _scan_module(self, module: Module, result: Scan) -> None:
        def is_os(node: ast.expr) -> bool:
            return isinstance(node, ast.Name) and module.imports.get(node.id) == ("os", None)

        def is_environ(node: ast.expr) -> bool:
            if isinstance(node, ast.Attribute):
                return node.attr == "environ" and is_os(node.value)
            # ``(os.environ if environ is None else environ).get(...)``
            if isinstance(node, ast.IfExp):
                return is_environ(node.body) or is_environ(node.orelse)
            if isinstance(node, ast.BoolOp):
                return any(is_environ(value) for value in node.values)
            return isinstance(node, ast.Name) and node.id == "environ"

        def is_getenv(node: ast.expr) -> bool:
            if isinstance(node, ast.Attribute):
                return node.attr == "getenv" and is_os(node.value)
            return isinstance(node, ast.Name) and module.imports.get(node.id) == ("os", "getenv")

        def record(node: ast.expr, line: int) -> None:
            where = f"{module.name}:{line}"
            name = self.key(module, node)
            if name is None:
                result.unresolved.append(f"{where}: {ast.unparse(node)}")
            else:
                result.reads.append(Read(name, where))

        # A pop whose value nobody uses is a scrub, not a read.
        dropped = {id(s.value) for s in ast.walk(module.tree) if isinstance(s, ast.Expr)}
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if OURS.fullmatch(node.value):
                    result.ours.add(node.value)
            elif isinstance(node, ast.Subscript):
                if isinstance(node.ctx, ast.Load) and is_environ(node.value):
                    record(node.slice, node.lineno)
            elif isinstance(node, ast.Compare):
                left = node.left
                for op, right in zip(node.ops, node.comparators, strict=True):
                    if isinstance(op, (ast.In, ast.NotIn)) and is_environ(right):
                        record(left, node.lineno)
                    left = right
            elif isinstance(node, ast.Call):
                func = node.func
                reads_mapping = (
                    isinstance(func, ast.Attribute)
                    and func.attr in _MAPPING_READS
                    and is_environ(func.value)
                    and not (func.attr == "pop" and id(node) in dropped)
                )
                if (reads_mapping or is_getenv(func)) and node.args:
                    record(node.args[0], node.lineno)
                for keyword in node.keywords:
                    if keyword.arg == "envvar":
                        value = keyword.value
                        items = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
                        for item in items:
                            record(item, node.lineno)


def source_modules(src: Path = SRC) -> Iterator[Module]:
    """Every module under ``src/``, named as Python imports it."""
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        yield load_module(".".join(parts), path.read_text(encoding="utf-8"), is_package=is_package)


def documented(page_text: str) -> set[str]:
    """The names in the first column of the tables under ``## Read by rootstock``."""
    _before, found, rest = page_text.partition(f"\n{READ_SECTION}\n")
    if not found:
        raise ValueError(f"{PAGE.name} has no {READ_SECTION!r} section")
    section = rest.split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("|"):
            first_cell = line.strip().strip("|").split("|", 1)[0]
            names.update(_BACKTICKED_NAME.findall(first_cell))
    return names


@pytest.fixture(scope="module")
def src_scan() -> Scan:
    return Scanner(source_modules()).scan()


@pytest.fixture(scope="module")
def page_names() -> set[str]:
    return documented(PAGE.read_text(encoding="utf-8"))


def _by_name(reads: Iterable[Read]) -> dict[str, list[str]]:
    places: dict[str, list[str]] = {}
    for read in reads:
        places.setdefault(read.name, []).append(read.where)
    return places


def test_every_variable_src_reads_is_documented(src_scan: Scan, page_names: set[str]) -> None:
    missing = {
        name: where for name, where in _by_name(src_scan.reads).items() if name not in page_names
    }
    assert not missing, (
        f"read in src/ but missing from docs/{PAGE.name} ({READ_SECTION}): "
        + "; ".join(
            f"{name} (read at {', '.join(where)})" for name, where in sorted(missing.items())
        )
    )


def test_every_env_read_in_src_names_a_resolvable_variable(src_scan: Scan) -> None:
    assert not src_scan.unresolved, (
        "environment reads whose variable name the scan cannot resolve (use a string "
        "literal or a module-level constant): " + "; ".join(src_scan.unresolved)
    )


def test_every_rootstock_name_in_src_is_documented(src_scan: Scan, page_names: set[str]) -> None:
    assert src_scan.ours, "the scan found no ROOTSTOCK_* string in src/ at all"
    missing = sorted(src_scan.ours - page_names)
    assert not missing, f"ROOTSTOCK_* names in src/ missing from docs/{PAGE.name}: {missing}"


def test_every_documented_rootstock_variable_is_read(src_scan: Scan, page_names: set[str]) -> None:
    read = {r.name for r in src_scan.reads}
    stale = sorted(n for n in page_names if OURS.fullmatch(n) and n not in read)
    assert not stale, f"docs/{PAGE.name} lists ROOTSTOCK_* variables nothing in src/ reads: {stale}"


# --- the scanner itself, on small modules written here -------------------------------------

_CONSTANTS = """
SHARED_ENV = "ROOTSTOCK_SHARED"
"""

_REEXPORT = """
from pkg.constants import SHARED_ENV
"""

_READER = """
import os
import pkg.constants as constants
from os import environ, getenv
from pkg.reexport import SHARED_ENV as ALIAS

LOCAL_ENV = "ROOTSTOCK_LOCAL"
NOT_ENV: str = "ROOTSTOCK_ANNOTATED"

def reads(environ_param, env):
    os.environ["SUBSCRIPT"]
    os.environ.get(LOCAL_ENV)
    os.getenv("GETENV")
    getenv("BARE_GETENV")
    environ.get(ALIAS)
    if "MEMBER" not in os.environ:
        pass
    taken = os.environ.pop("POPPED_AND_USED", "")
    os.environ.setdefault(constants.SHARED_ENV, "x")
    environ[NOT_ENV]
    click_option(envvar="CLICK")
    click_option(envvar=("CLICK_A", "CLICK_B"))
    os.environ.get(some_call())
    (os.environ if environ_param is None else environ_param).get("CHOSEN_MAPPING")
    (environ_param or os.environ)["EITHER_MAPPING"]

def not_reads(env):
    os.environ.pop("SCRUBBED", None)
    del os.environ["DELETED"]
    os.environ["WRITTEN"] = "1"
    env = dict(os.environ)
    env["CHILD_ONLY"] = "1"
    env.get("CHILD_DICT")
    child = {**os.environ, "LC_ALL": "C"}
"""


def _sample_scan() -> Scan:
    modules = [
        load_module("pkg", "", is_package=True),
        load_module("pkg.constants", _CONSTANTS),
        load_module("pkg.reexport", _REEXPORT),
        load_module("pkg.reader", _READER),
    ]
    return Scanner(modules).scan()


def test_scanner_finds_each_way_of_reading_a_variable() -> None:
    scan = _sample_scan()
    assert {r.name for r in scan.reads} == {
        "SUBSCRIPT",
        "ROOTSTOCK_LOCAL",
        "GETENV",
        "BARE_GETENV",
        "ROOTSTOCK_SHARED",  # through an import of a re-export, and through module.CONST
        "MEMBER",
        "POPPED_AND_USED",
        "ROOTSTOCK_ANNOTATED",
        "CLICK",
        "CLICK_A",
        "CLICK_B",
        "CHOSEN_MAPPING",
        "EITHER_MAPPING",
    }
    assert Read("SUBSCRIPT", "pkg.reader:11") in scan.reads


def test_scanner_reports_a_key_it_cannot_resolve() -> None:
    scan = _sample_scan()
    assert scan.unresolved == ["pkg.reader:23: some_call()"]


def test_scanner_ignores_writes_scrubs_and_child_environments() -> None:
    names = {r.name for r in _sample_scan().reads}
    for name in ("SCRUBBED", "DELETED", "WRITTEN", "CHILD_ONLY", "CHILD_DICT", "LC_ALL"):
        assert name not in names


def test_scanner_collects_every_whole_rootstock_string() -> None:
    assert _sample_scan().ours == {"ROOTSTOCK_SHARED", "ROOTSTOCK_LOCAL", "ROOTSTOCK_ANNOTATED"}


def test_page_parser_reads_only_the_first_column_of_its_section() -> None:
    page = "\n".join(
        [
            "# Environment variables",
            "| variable | read by | what it does | default |",
            "| `BEFORE_SECTION` | x | y | z |",
            READ_SECTION,
            "### A group",
            "| variable | read by | what it does | default |",
            "|---|---|---|---|",
            "| `ONE`, `TWO` | `install/x.py` | sets `NOT_FIRST_COLUMN` | unset |",
            "## Another section",
            "| `AFTER_SECTION` | x | y | z |",
        ]
    )
    assert documented(page) == {"ONE", "TWO"}


def test_page_parser_refuses_a_page_without_the_section() -> None:
    with pytest.raises(ValueError, match="Read by rootstock"):
        documented("# Environment variables\n| `X` | a | b | c |\n")
