"""The import rules of docs/architecture.md, checked against every module's source.

Each module under ``src/rootstock`` is parsed with ``ast`` (nothing is imported), and
every import is collected: function-level and ``TYPE_CHECKING`` ones included,
relative ones resolved. The layer rules are read from the doc's own table, so the doc
and this test cannot disagree; the rules the table cannot hold (the shared modules,
the one uv chokepoint, the worker's env-only imports) are written here and in the
prose under that table. The last tests show that tests/unit starts no process
(``tests/unit/conftest.py``).
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PACKAGE = SRC / "rootstock"
DOC = REPO / "docs" / "architecture.md"

ROOT = "rootstock"
#: Beside the layers; every layer may import them (the doc, under the table).
SHARED = {ROOT, "rootstock.errors", "rootstock.names", "rootstock.version"}
#: What the shared modules themselves may import from rootstock.
SHARED_RULES = {
    "rootstock.errors": set(),
    "rootstock.names": {"rootstock.errors"},
    "rootstock.version": set(),
}
#: The bottom layer, frozen into every built env: every layer may import it.
BOTTOM = "wire"
#: What the package root imports when it loads (the rest only on first access).
ROOT_AT_LOAD = {"rootstock.errors", "rootstock.version"}
#: Outside the standard library, what a built env is sure to hold.
ENV_PACKAGES = {"numpy", "ase"}
UV_MODULE = "rootstock.install.uv"
UV_LOOKUPS = {"uv_binary", "find_uv_bin"}
#: Calls that look a program up or start it, given its name first.
UV_RUNNERS = {
    "which",
    "run",
    "Popen",
    "call",
    "check_call",
    "check_output",
    "run_supervised",
    "create_subprocess_exec",
    "execvp",
    "execlp",
    "spawnvp",
    "spawnlp",
    "system",
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, as the importing module sees it."""

    module: str  # the importing module, dotted
    target: str  # the imported module, dotted and absolute
    line: int
    lazy: bool  # inside a function: runs only when called
    type_only: bool  # under ``if TYPE_CHECKING:``: never runs

    def where(self) -> str:
        path = module_path(self.module).relative_to(REPO)
        how = " (in a function)" if self.lazy else " (TYPE_CHECKING)" if self.type_only else ""
        return f"{path}:{self.line}: {self.module} imports {self.target}{how}"


def module_path(module: str) -> Path:
    path = SRC.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def all_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module = module
        self.package = module.split(".") if is_package else module.split(".")[:-1]
        self.known = known
        self.found: list[Import] = []
        self._functions = 0
        self._type_checking = 0

    def _add(self, target: str, node: ast.stmt) -> None:
        self.found.append(
            Import(self.module, target, node.lineno, self._functions > 0, self._type_checking > 0)
        )

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._functions += 1
        self.generic_visit(node)
        self._functions -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._type_checking += 1
        for child in node.body:
            self.visit(child)
        self._type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base_parts = self.package[: len(self.package) - node.level + 1]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        # ``from rootstock import names`` imports a module; ``from x import f`` a name.
        targets = [f"{base}.{a.name}" for a in node.names]
        for target in dict.fromkeys(t if t in self.known else base for t in targets):
            self._add(target, node)


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[Import]:
    """Every import in ``source``, read as module ``module`` (relative ones resolved)."""
    collector = _ImportCollector(module, is_package, known)
    collector.visit(ast.parse(source))
    return collector.found


def scan() -> dict[str, list[Import]]:
    modules = all_modules()
    known = set(modules)
    return {
        name: imports_of(name, path.read_text(), known, path.name == "__init__.py")
        for name, path in modules.items()
    }


def layer_of(module: str) -> str | None:
    """``rootstock.install.uv`` -> ``install``; None for the root and top-level modules."""
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return None


def _doc_target(token: str) -> str:
    # `install/` is the package, `runtime/lifeline` one module, `install/manifest/` a package.
    target = ".".join([ROOT, *token.strip("/").split("/")])
    path = SRC.joinpath(*target.split("."))
    kind, real = ("package", path / "__init__.py") if token.endswith("/") else ("module", path)
    assert real.with_suffix(".py").is_file(), (
        f"docs/architecture.md's layer table names `{token}`: no such {kind} in src/rootstock"
    )
    return target


def doc_rules(text: str) -> dict[str, list[str]]:
    """The layer table of docs/architecture.md: layer -> the targets it may import."""
    rules: dict[str, list[str]] = {}
    in_table = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == "layer" and cells[-1] == "may import":
            in_table = True
            continue
        if not in_table:
            continue
        if not line.startswith("|"):
            break
        if set(cells[0]) <= set("-: "):
            continue  # the |---| row
        layer = re.fullmatch(r"`(\w+)/`", cells[0])
        assert layer, f"docs/architecture.md: a layer row must start with `name/`: {line}"
        rules[layer.group(1)] = [_doc_target(t) for t in re.findall(r"`([^`]+)`", cells[-1])]
    return rules


def allowed(target: str, prefixes: list[str] | set[str]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def layer_violations(found: dict[str, list[Import]], rules: dict[str, list[str]]) -> list[str]:
    """One line per import that breaks the doc's table (module, import and rule)."""
    problems = []
    for module, imports in found.items():
        layer = layer_of(module)
        if layer is None:
            continue
        for imp in imports:
            if imp.target.split(".")[0] != ROOT:
                continue
            if layer_of(imp.target) in (layer, BOTTOM) or imp.target in SHARED:
                continue
            if layer not in rules:
                problems.append(f"{imp.where()}: {layer}/ has no row in the layer table")
            elif not allowed(imp.target, rules[layer]):
                names = ", ".join(rules[layer]) or "nothing else"
                problems.append(
                    f"{imp.where()}: the rule for {layer}/ in docs/architecture.md allows, "
                    f"besides {layer}/ itself, wire/ and the shared errors, names and "
                    f"version, only: {names}"
                )
    return problems


@pytest.fixture(scope="module")
def found() -> dict[str, list[Import]]:
    return scan()


# --- the scanner itself -----------------------------------------------------------------


def test_the_scanner_resolves_relative_lazy_and_type_only_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import envs\n"
        "from ..errors import BuildError\n"
        "if TYPE_CHECKING:\n"
        "    from rootstock.runtime.spec import WorkerSpec\n"
        "def later():\n"
        "    from ..ops import status\n"
        "    import numpy.linalg\n"
    )
    known = {"rootstock.install.envs", "rootstock.ops.status", "rootstock.errors"}
    got = {
        (i.target, i.lazy, i.type_only)
        for i in imports_of("rootstock.install.x", source, known)
        if i.target != "typing"
    }
    assert got == {
        ("rootstock.install.envs", False, False),
        ("rootstock.errors", False, False),
        ("rootstock.runtime.spec", False, True),
        ("rootstock.ops.status", True, False),
        ("numpy.linalg", True, False),
    }
    # In a package's __init__, one dot is the package itself.
    [inside] = imports_of("rootstock.install", "from .uv import run_uv\n", set(), True)
    assert inside.target == "rootstock.install.uv"


def test_a_lazy_import_across_a_rule_is_reported_with_module_import_and_rule():
    imports = imports_of(
        "rootstock.install.build", "def f():\n    from rootstock.ops import add\n", set()
    )
    [problem] = layer_violations({"rootstock.install.build": imports}, {"install": []})
    assert "src/rootstock/install/build.py:2" in problem
    assert "rootstock.install.build imports rootstock.ops (in a function)" in problem
    assert "the rule for install/" in problem


def test_the_doc_table_has_a_row_for_every_layer():
    rules = doc_rules(DOC.read_text())
    layers = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert set(rules) == layers, "docs/architecture.md's layer table and src/rootstock differ"
    assert rules["dashboard"] == ["rootstock.install.manifest"]
    # The worker and install reach the frozen contract, and only it, below every layer.
    assert set(rules["worker"]) <= {"rootstock.wire"} and set(rules["install"]) <= {
        "rootstock.wire"
    }
    assert rules["wire"] == []


# --- the rules ----------------------------------------------------------------------------


def test_every_import_follows_the_layer_table(found):
    problems = layer_violations(found, doc_rules(DOC.read_text()))
    assert not problems, "imports that break docs/architecture.md:\n" + "\n".join(problems)


def test_errors_names_and_version_sit_below_every_layer(found):
    problems = [
        f"{imp.where()}: {module} may import only {sorted(rule) or 'nothing'} from rootstock"
        for module, rule in SHARED_RULES.items()
        for imp in found[module]
        if imp.target.split(".")[0] == ROOT and imp.target not in rule
    ]
    assert not problems, "\n".join(problems)


def test_the_package_root_loads_only_errors_and_version(found):
    problems = [
        f"{imp.where()}: rootstock/__init__.py must load only errors and version "
        "(anything else on first access), so --help and the worker stay light"
        for imp in found[ROOT]
        if imp.target.split(".")[0] == ROOT
        and not (imp.lazy or imp.type_only)
        and imp.target not in ROOT_AT_LOAD
    ]
    assert not problems, "\n".join(problems)


def test_no_module_imports_the_package_root(found):
    # The root loads the calculator on first access: a module that imported it would
    # be tied into a cycle with the runtime (take __version__ from rootstock.version).
    problems = [
        f"{imp.where()}: import what you need from its own module, not the package root"
        for module, imports in found.items()
        if module != ROOT
        for imp in imports
        if imp.target == ROOT
    ]
    assert not problems, "\n".join(problems)


def _stdlib_or_env(target: str) -> bool:
    top = target.split(".")[0]
    return top in sys.stdlib_module_names or top in ENV_PACKAGES


def _parents(module: str) -> Iterator[str]:
    parts = module.split(".")
    for n in range(1, len(parts)):
        yield ".".join(parts[:n])


def _path_to(module: str, chain: dict[str, str | None]) -> str:
    via: list[str] = []
    step: str | None = module
    while step is not None:
        via.append(step)
        step = chain[step]
    return " <- ".join(via)


def test_the_worker_needs_only_stdlib_numpy_and_ase(found):
    # Everything a worker module imports (lazily too: it runs in the env), then what
    # each rootstock module reached imports when it loads, parent packages included.
    start = [m for m in found if layer_of(m) == "worker"]
    chain: dict[str, str | None] = dict.fromkeys(start)
    todo = list(start)
    problems = []
    while todo:
        module = todo.pop()
        for imp in found[module]:
            if imp.type_only or (imp.lazy and layer_of(module) != "worker"):
                continue
            if imp.target.split(".")[0] != ROOT:
                if not _stdlib_or_env(imp.target):
                    problems.append(
                        f"{imp.where()}: reached from the worker by {_path_to(module, chain)}; "
                        "a built env holds only the standard library, numpy and ase"
                    )
                continue
            for reached in [*_parents(imp.target), imp.target]:
                if reached in found and reached not in chain:
                    chain[reached] = module
                    todo.append(reached)
    assert not problems, "\n".join(problems)
    assert "rootstock.wire.framing" in chain  # the walk did follow the worker's imports


def test_the_wire_needs_only_stdlib_and_numpy(found):
    # What every built env holds, old ones included: nothing of ase, nothing of a layer.
    wire = [m for m in found if layer_of(m) == BOTTOM]
    assert "rootstock.wire.framing" in wire
    problems = [
        f"{imp.where()}: wire/ is frozen into every env; it may import only the standard "
        "library, numpy and rootstock.errors"
        for module in wire
        for imp in found[module]
        if (
            not imp.type_only
            and (
                layer_of(imp.target) not in (None, BOTTOM)
                if imp.target.split(".")[0] == ROOT
                else imp.target.split(".")[0] not in sys.stdlib_module_names | {"numpy"}
            )
        )
        or imp.target in (ROOT, "rootstock.names", "rootstock.version")
    ]
    assert not problems, "\n".join(problems)


def import_graph(found: dict[str, list[Import]]) -> dict[str, set[str]]:
    """Module -> the rootstock modules it imports (lazily too; not for type checking)."""
    return {
        module: {
            imp.target
            for imp in imports
            if not imp.type_only and imp.target in found and imp.target != module
        }
        for module, imports in found.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other by imports (Tarjan's SCCs of size > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    imports = {
        "rootstock.a": imports_of("rootstock.a", "import rootstock.b\n", {"rootstock.b"}),
        "rootstock.b": imports_of(
            "rootstock.b", "def f():\n    from rootstock import a\n", {"rootstock.a"}
        ),
        "rootstock.c": imports_of("rootstock.c", "import rootstock.a\n", {"rootstock.a"}),
    }
    assert import_cycles(import_graph(imports)) == [["rootstock.a", "rootstock.b"]]


def test_no_module_imports_itself_back(found):
    # Function-level imports count: one that breaks a cycle only at load time still
    # ties the modules together for a reader and for every later change.
    cycles = import_cycles(import_graph(found))
    assert not cycles, "modules that import each other (directly or around a loop):\n" + (
        "\n".join(" <-> ".join(group) for group in cycles)
    )


# --- runtime/ has one face -----------------------------------------------------------

RUNTIME = "rootstock.runtime"
#: The only modules that call ``Popen`` themselves, and why each may.
POPEN_MODULES = {
    # Every process that runs a model or rootstock's worker-side code: the worker,
    # the benchmark's in-env probe, the pool daemon (start_process).
    "rootstock.runtime.spawn": "the one start of what runs a model",
    # The build supervisor runs uv and the build's probes (install/ cannot reach runtime/).
    "rootstock.install.supervise": "the build's commands",
    # The squashfuse keeper and squashfuse itself: a mount, no model.
    "rootstock.runtime.stage": "the stage's mount keeper",
    "rootstock.runtime.stage_keeper": "squashfuse",
}


def private_runtime_imports(found: dict[str, list[Import]]) -> list[str]:
    """Imports, outside runtime/, of a runtime module other than the package's face."""
    return [
        f"{imp.where()}: import it from {RUNTIME} (its __init__ exports what other "
        "layers may use; add the name there if it is missing)"
        for module, imports in found.items()
        if layer_of(module) != "runtime"
        for imp in imports
        if imp.target.startswith(RUNTIME + ".")
    ]


def test_the_runtime_check_catches_a_private_import_even_for_type_checking():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from rootstock.runtime import spawn_worker\n"
        "if TYPE_CHECKING:\n"
        "    from rootstock.runtime.spec import WorkerSpec\n"
        "def later():\n"
        "    from rootstock.runtime import shared\n"
    )
    known = {RUNTIME, "rootstock.runtime.spec", "rootstock.runtime.shared"}
    imports = {"rootstock.ops.x": imports_of("rootstock.ops.x", source, known)}
    problems = private_runtime_imports(imports)
    assert len(problems) == 2, problems
    assert "imports rootstock.runtime.spec (TYPE_CHECKING)" in problems[0]
    assert "imports rootstock.runtime.shared (in a function)" in problems[1]
    # Inside runtime/ its modules import each other freely.
    inside = {"rootstock.runtime.y": imports_of("rootstock.runtime.y", source, known)}
    assert private_runtime_imports(inside) == []


def test_nothing_outside_runtime_imports_its_private_modules(found):
    # TYPE_CHECKING imports count too: the face re-exports every type it names.
    problems = private_runtime_imports(found)
    assert not problems, "\n".join(problems)


def test_the_runtime_face_names_each_export_once_for_mypy_and_at_runtime():
    import rootstock.runtime as face

    # Every exported name is imported under TYPE_CHECKING from the module that
    # __getattr__ loads it from, so mypy and the running code agree.
    tree = ast.parse(module_path(RUNTIME).read_text())
    typed: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module
                for alias in stmt.names:
                    module = stmt.module.removeprefix(RUNTIME + ".")
                    typed[alias.asname or alias.name] = (module, alias.name)
    assert typed == face._FACE
    assert sorted(face.__all__) == sorted(face._FACE)
    for name in face.__all__:
        assert getattr(face, name) is not None, name
    with pytest.raises(AttributeError):
        _ = face.no_such_name


def test_only_the_chokepoints_call_popen():
    problems = []
    for module, path in all_modules().items():
        calls = [
            node.lineno
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and _called_name(node) == "Popen"
        ]
        if calls and module not in POPEN_MODULES:
            problems.append(
                f"{path.relative_to(REPO)}:{calls[0]}: {module} calls Popen; a process that "
                "runs a model or the worker starts in runtime/spawn.py (start_process)"
            )
    assert not problems, "\n".join(problems)


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _runs_uv(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Places in a module that look up or run the uv binary themselves."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module == "uv" or "uv" in names:
                yield node.lineno, "imports the uv package"
            for name in set(names) & UV_LOOKUPS:
                yield node.lineno, f"imports {name}"
        elif isinstance(node, ast.Name) and node.id in UV_LOOKUPS:
            yield node.lineno, f"calls {node.id}"
        elif isinstance(node, ast.Attribute) and node.attr in UV_LOOKUPS:
            yield node.lineno, f"calls .{node.attr}"
        elif isinstance(node, ast.Call) and node.args and _called_name(node) in UV_RUNNERS:
            first = node.args[0]
            if isinstance(first, ast.Constant) and first.value == "uv":
                yield node.lineno, f'passes "uv" to {_called_name(node)}'
        elif isinstance(node, ast.List | ast.Tuple):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if (node.elts and words[:1] == ["uv"] and isinstance(node.elts[0], ast.Constant)) or (
                "-m" in words and words[words.index("-m") + 1 : words.index("-m") + 2] == ["uv"]
            ):
                yield node.lineno, "builds a command that runs uv"


def test_only_install_uv_runs_uv():
    problems = []
    for module, path in all_modules().items():
        if module == UV_MODULE:
            continue
        for line, what in _runs_uv(ast.parse(path.read_text())):
            problems.append(
                f"{path.relative_to(REPO)}:{line}: {module} {what}; only {UV_MODULE} runs uv "
                "(docs/architecture.md): call run_uv, or add what you need to uv.py"
            )
    assert not problems, "\n".join(problems)


def test_the_uv_check_catches_each_way_of_running_uv():
    sources = {
        "from rootstock.install.uv import uv_binary\n": "imports uv_binary",
        "from uv import find_uv_bin\n": "imports the uv package",
        "import shutil\nshutil.which('uv')\n": 'passes "uv" to which',
        "cmd = ['uv', 'pip', 'install']\n": "builds a command",
        "import sys\ncmd = (sys.executable, '-m', 'uv', '--version')\n": "builds a command",
        "uv.uv_binary()\n": "calls .uv_binary",
    }
    for source, expected in sources.items():
        found = [what for _line, what in _runs_uv(ast.parse(source))]
        assert any(expected in what for what in found), (source, found)
    harmless = "tool = meta.get('uv', {})\nx = meta['tool']['uv']\ncmd = ['pip', 'uv']\n"
    assert list(_runs_uv(ast.parse(harmless))) == []


# --- tests/unit starts no process (the guard in tests/unit/conftest.py) -----------------


def test_a_unit_test_cannot_start_a_subprocess(refused_process_starts):
    with pytest.raises(AssertionError, match="tests/unit starts no process"):
        subprocess.run([sys.executable, "-c", "pass"], check=False, timeout=10)
    with pytest.raises(AssertionError, match="tests/unit starts no process"):
        os.fork()
    assert refused_process_starts == ["subprocess.Popen", "os.fork"]
    refused_process_starts.clear()  # seen and expected: the guard must not fail this test


def test_a_swallowed_refusal_is_still_recorded(refused_process_starts):
    with contextlib.suppress(Exception):  # as code under test might: it is recorded anyway
        os.system("true")
    assert refused_process_starts == ["os.system"]
    refused_process_starts.clear()
