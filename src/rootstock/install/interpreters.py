"""Choosing the base interpreter an env is built on.

uv-managed Pythons under ``{root}/.python`` come first, but ``uv python install``
downloads from a host that many clusters (and air-gapped test machines) cannot
reach. Then the build falls back to a local interpreter that satisfies the env's
``requires-python``, preferring one every user can execute: an env built on a
Python under a private home directory is unusable by everyone else. Probes and
downloads run under the build supervisor, like every subprocess of a build.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from rootstock.errors import BuildError, EnvFileError
from rootstock.install.layout import InstallLayout
from rootstock.install.parsing import loads_json
from rootstock.install.supervise import run_supervised
from rootstock.install.uv import run_uv

_DOWNLOAD_FAILED_MARKER = ".downloads-unavailable.json"
_DOWNLOAD_RETRY_AFTER_S = 6 * 3600
_PROBE = (
    "import json, sys; print(json.dumps([sys.executable, "
    "'%d.%d.%d' % sys.version_info[:3], sys.implementation.name]))"
)


@dataclass(frozen=True)
class Interpreter:
    """A base Python an env can be built on."""

    path: Path
    version: str
    source: str  # "explicit", "managed", "local" or "recorded"
    world_usable: bool

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "version": self.version,
            "source": self.source,
            "world_usable": self.world_usable,
        }


@dataclass(frozen=True)
class InterpreterChoice:
    """The chosen interpreter and the one-line notes the user should see."""

    interpreter: Interpreter
    notes: list[str]


def world_usable(path: Path) -> bool:
    """True when every user can execute ``path``: o+x on it and o+x on each ancestor."""
    real = Path(os.path.realpath(path))
    try:
        if not real.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)
    except OSError:
        return False


def probe_interpreter(path: str | Path, source: str) -> Interpreter | None:
    """Ask ``path`` what it is; None if it is not a working CPython."""
    try:
        proc = run_supervised([str(path), "-I", "-c", _PROBE], timeout=15)
        if proc.returncode != 0:
            return None
        executable, version, impl = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    if impl != "cpython":
        return None
    return Interpreter(Path(executable), version, source, world_usable(Path(executable)))


def _specifier(requires_python: str | None, origin: str) -> SpecifierSet:
    try:
        return SpecifierSet(requires_python or "")
    except InvalidSpecifier:
        raise EnvFileError(
            f"{origin}: requires-python {requires_python!r} is not a valid version specifier",
            hint='write e.g. requires-python = ">=3.11"',
        ) from None


def local_interpreters() -> list[Interpreter]:
    """Every distinct CPython found in the usual places on this machine."""
    names = ["python3", *(f"python3.{minor}" for minor in range(8, 16))]
    candidates: list[str] = []
    for directory in ("/usr/bin", "/usr/local/bin"):
        candidates += [os.path.join(directory, n) for n in names]
    candidates += [path for n in names if (path := shutil.which(n))]
    candidates.append(getattr(sys, "_base_executable", sys.executable))
    seen: set[str] = set()
    found: list[Interpreter] = []
    for candidate in candidates:
        if not os.path.exists(candidate):
            continue
        interp = probe_interpreter(candidate, "local")
        if interp and (key := os.path.realpath(interp.path)) not in seen:
            seen.add(key)
            found.append(interp)
    return found


def _preference(interp: Interpreter) -> tuple:
    client_minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    same_minor = interp.version.rsplit(".", 1)[0] == client_minor
    return (
        not interp.world_usable,
        not same_minor,
        -Version(interp.version).major,
        -Version(interp.version).minor,
    )


def choose_interpreter(
    layout: InstallLayout,
    requires_python: str | None,
    origin: str,
    explicit: str | None = None,
    verbose: bool = False,
    shared: bool = True,
) -> InterpreterChoice:
    """Pick the base interpreter for an env, in the documented order.

    On a ``shared`` root, one that others cannot execute draws a warning; a private
    root's envs need work only for their owner.
    """
    spec = _specifier(requires_python, origin)
    notes: list[str] = []
    if explicit:
        interp = _explicit(explicit, spec)
    else:
        managed = _managed(layout, requires_python, notes, verbose)
        interp = managed if managed is not None else _local(spec, requires_python, origin, notes)
    if shared and not interp.world_usable:
        notes.append(
            f"warning: {interp.path} is not executable by other users (a private home "
            "directory?); envs built on it are unusable by everyone else on a shared "
            "install: pass --python with a system-wide interpreter"
        )
    return InterpreterChoice(interp, notes)


def _explicit(explicit: str, spec: SpecifierSet) -> Interpreter:
    if os.sep in explicit or os.path.exists(explicit):
        interp = probe_interpreter(explicit, "explicit")
        if interp is None:
            raise BuildError(f"--python {explicit}: not a working CPython interpreter")
        return interp
    matches = [
        i
        for i in local_interpreters()
        if i.version == explicit or i.version.startswith(explicit + ".")
    ]
    if not matches:
        raise BuildError(
            f"--python {explicit}: no local CPython {explicit} found",
            hint="pass the interpreter's full path instead",
        )
    best = sorted(matches, key=_preference)[0]
    return Interpreter(best.path, best.version, "explicit", best.world_usable)


def _managed(
    layout: InstallLayout, requires_python: str | None, notes: list[str], verbose: bool
) -> Interpreter | None:
    request = requires_python or "3"
    found = _find_managed(layout, request)
    if found:
        return found
    marker = layout.python_dir / _DOWNLOAD_FAILED_MARKER
    if _recent_failure(marker):
        notes.append(
            f"uv-managed Python downloads failed recently; using a local interpreter "
            f"(delete {marker} to retry the download)"
        )
        return None
    try:
        run_uv(
            layout,
            # --no-bin: no `python3.X` link in a bin directory ($XDG_BIN_HOME, which passes
            # through, or the redirected HOME); envs use the interpreter under .python.
            ["python", "install", "--no-bin", request],
            what="installing a managed Python",
            verbose=verbose,
            timeout=600,
            extra_env={"UV_HTTP_RETRIES": "0"},
        )
    except BuildError as exc:
        reason = (exc.output.strip().splitlines() or [exc.message])[-1].strip()
        layout.python_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"at": time.time(), "reason": reason}))
        notes.append(
            f"uv could not download a managed Python ({reason}); using a local interpreter"
        )
        return None
    return _find_managed(layout, request)


def _find_managed(layout: InstallLayout, request: str) -> Interpreter | None:
    if not layout.python_dir.is_dir():
        return None
    try:
        out = run_uv(
            layout,
            ["python", "find", "--managed-python", "--no-python-downloads", request],
            what="finding a managed Python",
        )
    except BuildError:
        return None
    path = out.strip().splitlines()[-1] if out.strip() else ""
    if not path or not Path(path).is_relative_to(layout.python_dir):
        return None
    interp = probe_interpreter(path, "managed")
    return interp


def _recent_failure(marker: Path) -> bool:
    try:
        at = loads_json(marker.read_bytes())["at"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return time.time() - float(at) < _DOWNLOAD_RETRY_AFTER_S


def _local(
    spec: SpecifierSet, requires_python: str | None, origin: str, notes: list[str]
) -> Interpreter:
    candidates = [i for i in local_interpreters() if spec.contains(i.version, prereleases=True)]
    if not candidates:
        raise BuildError(
            f"{origin}: no local Python satisfies requires-python {requires_python!r}, and "
            "uv could not download one",
            hint="install a matching Python (e.g. the distribution's python3.11 package) and "
            "pass it with --python PATH",
        )
    best = sorted(candidates, key=_preference)[0]
    notes.append(f"using local interpreter {best.path} (Python {best.version})")
    return best
