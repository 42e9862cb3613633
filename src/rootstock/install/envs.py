"""Installed envs, and which env serves a checkpoint id.

Ids resolve from the *built* ``envs/<name>/env_source.py`` (which a hotfix may
edit), never from ``environments/*.py`` (which only builds read). Nothing is
cached across calls: every resolution reads the files afresh.

A built env whose ``env_source.py`` no longer parses (a hotfix with a syntax
error) is *broken*: it is reported with ``file:line: message`` wherever the env
would show, never dropped. Its ids are then the ones the manifest recorded from
the last good parse.

Every name a user types (an env, a checkpoint id) that is not known goes through
:func:`unknown_name`, the one rule: a usage error (exit code 2) listing close
matches.
"""

from __future__ import annotations

import ast
import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, overload

from rootstock.errors import (
    AmbiguousCheckpoint,
    CheckpointNotDeclared,
    EnvBroken,
    EnvFileError,
    EnvNotFound,
    ManifestError,
    UnknownEnvName,
    UsageError,
)
from rootstock.install.envfile import (
    EnvFile,
    LintProblem,
    is_custom_id,
    parse_env_file,
    source_hash,
)
from rootstock.install.layout import InstallLayout
from rootstock.install.parsing import (
    SMALL_FILE_MAX_BYTES,
    ParseProblem,
    loads_json,
    read_regular_file,
    require_regular_file,
)
from rootstock.install.samples import path_to_pass, sample_declaring

ENV_METADATA = "rootstock-env.json"
_E = TypeVar("_E", bound=UsageError)


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """A checkpoint id bound to the env that serves it on this cluster."""

    checkpoint: str
    env: EnvFile
    upstream: str | None

    @property
    def env_name(self) -> str:
        return self.env.name

    @property
    def is_custom(self) -> bool:
        return is_custom_id(self.checkpoint)


@dataclass(frozen=True)
class BrokenEnv:
    """A built env whose ``env_source.py`` cannot be read: every spawn of it fails.

    ``recorded_ids`` are the checkpoint ids the manifest holds for it (the ids of
    its last good parse); ``fetched_ids`` the ones among them with weights.
    """

    name: str
    path: Path
    line: int
    reason: str
    recorded_ids: tuple[str, ...] = ()
    fetched_ids: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        """``file:line: reason``, the text every command shows for this env."""
        return f"{self.path}:{self.line}: {self.reason}"

    def live_source_hash(self) -> str | None:
        """The hash of the file as it is now (what a failure is recorded against)."""
        try:
            require_regular_file(self.path)  # never wait on a FIFO
            return source_hash(self.path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, ParseProblem):
            return None

    def error(self, what: str | None = None) -> EnvBroken:
        """The error a command raises when it needs this env (``what`` says for what)."""
        subject = f"{what} is served by env {self.name!r}, which" if what else f"env {self.name!r}"
        return EnvBroken(
            f"{subject} is broken: its env_source.py does not parse: {self.message}",
            hint=f"fix {self.path} (python -m py_compile), or rebuild the env: "
            f"rootstock install {self.name} --force",
        )


@dataclass
class InstalledEnvs:
    """Every built env of a root: the ones that parse, and the broken ones."""

    envs: list[EnvFile] = field(default_factory=list)
    broken: list[BrokenEnv] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """Every built env's name, broken ones included."""
        return sorted([e.name for e in self.envs] + [b.name for b in self.broken])

    @property
    def warnings(self) -> list[str]:
        """One line per broken env, for commands that list envs."""
        return [f"env {b.name!r} is broken: {b.message}" for b in self.broken]

    def broken_env(self, name: str) -> BrokenEnv | None:
        """The broken env called ``name``, or None."""
        return next((b for b in self.broken if b.name == name), None)


def installed_env_names(layout: InstallLayout) -> list[str]:
    """Names of envs that finished building (they have an env_source.py).

    Whatever ``env_source.py`` has become (a directory, a FIFO, a dangling link)
    counts: such an env is broken, and must show as broken rather than vanish.
    """
    if not layout.envs_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in layout.envs_dir.iterdir()
        if not p.name.startswith(".") and os.path.lexists(p / "env_source.py")
    )


def load_installed_env(layout: InstallLayout, name: str) -> EnvFile:
    """Parse one built env's ``env_source.py``; lint problems do not stop reading.

    Raises :class:`EnvBroken` when the file cannot be read or does not parse.
    """
    path = layout.env_source(name)
    if not os.path.lexists(path):
        raise EnvNotFound(
            f"no env named {name!r} is installed in {layout.root}",
            hint=f"install it with `rootstock install environments/{name}.py`",
        )
    parsed = _parse_built(path, name, _kind_problem(path))
    if isinstance(parsed, BrokenEnv):
        raise parsed.error()
    return parsed


def scan_installed_envs(layout: InstallLayout) -> InstalledEnvs:
    """Every built env, each parsed or reported broken (with its recorded ids)."""
    found = InstalledEnvs()
    recorded: dict | None = None
    for name, kind_problem in _built_sources(layout):
        parsed = _parse_built(layout.env_source(name), name, kind_problem)
        if isinstance(parsed, EnvFile):
            found.envs.append(parsed)
            continue
        broken = parsed
        if recorded is None:
            recorded = _recorded_checkpoints(layout)
        entries = recorded.get(name) or {}
        found.broken.append(
            BrokenEnv(
                broken.name,
                broken.path,
                broken.line,
                broken.reason,
                tuple(sorted(entries)),
                tuple(sorted(c for c, e in entries.items() if (e or {}).get("fetched_at"))),
            )
        )
    return found


def _built_sources(layout: InstallLayout) -> list[tuple[str, ParseProblem | None]]:
    """The envs :func:`installed_env_names` lists, each with what its ``env_source.py``
    is when that is not a regular file.

    Every calculator's start runs this, so each env costs one ``stat`` here and one
    ``open`` to parse it: on a shared filesystem each path lookup is a round trip to
    its metadata server (docs/cold-start.md).
    """
    try:
        names = sorted(n for n in os.listdir(layout.envs_dir) if not n.startswith("."))
    except OSError:
        return []
    sources: list[tuple[str, ParseProblem | None]] = []
    for name in names:
        path = layout.env_source(name)
        try:
            require_regular_file(path)  # a directory fails to read, a FIFO would block
        except ParseProblem as exc:
            sources.append((name, exc))
            continue
        except OSError:
            # As installed_env_names: listed when anything is there (a dangling link,
            # which the parse reports), not when nothing is (a build under way, a file).
            if not os.path.lexists(path):
                continue
        sources.append((name, None))
    return sources


def load_installed_envs(layout: InstallLayout) -> tuple[list[EnvFile], list[str]]:
    """Every built env that parses, plus a warning line for each broken one."""
    found = scan_installed_envs(layout)
    return found.envs, found.warnings


def _kind_problem(path: Path) -> ParseProblem | None:
    """What ``path`` is when it is not a regular file (a directory fails to read, a FIFO
    would block); None when it is one, or when reading it will name the error."""
    try:
        require_regular_file(path)
    except ParseProblem as exc:
        return exc
    except OSError:
        pass
    return None


def _parse_built(path: Path, name: str, kind_problem: ParseProblem | None) -> EnvFile | BrokenEnv:
    """Parse a built ``env_source.py``: the env, or why it is broken (``kind_problem``:
    what :func:`_kind_problem` found)."""
    if kind_problem is not None:
        return BrokenEnv(name, path, 1, str(kind_problem))
    try:
        env, problems = parse_env_file(path, name)
    except EnvFileError as exc:
        return BrokenEnv(name, path, 1, exc.message)
    except ValueError as exc:  # a NUL byte, which some Pythons' parser refuses this way
        return BrokenEnv(name, path, 1, f"syntax error: {exc}")
    fatal = _fatal_problem(env, problems)
    if fatal is None:
        return env
    line, reason = fatal
    return BrokenEnv(name, path, line, reason)


def _fatal_problem(env: EnvFile, problems: list[LintProblem]) -> tuple[int, str] | None:
    """The first problem that stops the env from working at all, or None.

    Other lint problems (a ``:custom`` id without its hook, say) spoil one feature
    and are reported where that feature is used; these break every spawn or hide
    the env's ids: the file does not compile, has no ``setup()``, or its
    ``CHECKPOINTS`` table cannot be read or is empty (a hotfix that empties it
    would otherwise make every recorded id vanish without a word).
    """
    if "setup" not in env.functions:
        # The parser stops at a syntax error before it sees any function, so only
        # then is it worth compiling again to find out which of the two this is.
        try:
            ast.parse(env.source, filename=str(env.path))
        except SyntaxError as exc:
            return exc.lineno or 1, f"syntax error: {exc.msg}"
        except ValueError as exc:  # a NUL byte: not even tokenisable
            return 1, f"syntax error: {exc}"
        return 1, "no top-level setup() function"
    table_line = env.table_lines.get("CHECKPOINTS")
    if table_line is None:
        return 1, "no module-level CHECKPOINTS table"
    if not env.checkpoints:
        for problem in problems:
            if problem.line == table_line and "CHECKPOINTS" in problem.message:
                return problem.line, problem.message
    return None


def _recorded_checkpoints(layout: InstallLayout) -> dict[str, dict]:
    """``{env: {id: record}}`` from the manifest; empty if it is missing or untrusted.

    Only broken envs need it, and their report must not fail on a bad manifest
    (the commands that write it refuse that on their own).
    """
    from rootstock.install.manifest import load_manifest

    try:
        manifest = load_manifest(layout)
    except (ManifestError, UsageError, OSError):
        return {}
    return {
        name: dict(entry.get("checkpoints") or {})
        for name, entry in (manifest.get("envs") or {}).items()
        if isinstance(entry, dict)
    }


def recorded_weights(layout: InstallLayout, env_name: str, checkpoint: str) -> dict[str, dict]:
    """The checkpoint's recorded weight files (``{path: {size, sha256, mtime}}``, paths
    relative to the cache root); empty when none are recorded or the manifest cannot be
    read.

    A worker start asks this, so it is a lean read: the JSON parsed, neither migrated
    nor validated (a large install's manifest is megabytes), and what it gives is only
    a hint for a warning (verification re-reads the manifest properly).
    """
    try:
        manifest = loads_json(read_regular_file(layout.manifest_file, None))
    except (OSError, ParseProblem, ValueError):
        return {}
    node: object = manifest
    for key in ("envs", env_name, "checkpoints", checkpoint, "weights"):
        node = node.get(key) if isinstance(node, dict) else None
    return {
        path: entry
        for path, entry in (node.items() if isinstance(node, dict) else ())
        if isinstance(path, str) and isinstance(entry, dict)
    }


def envs_on_cluster(envs: list[EnvFile], cluster: str | None) -> list[EnvFile]:
    """The envs that apply on ``cluster``: universal ones plus its variants."""
    return [
        e for e in envs if not e.is_variant or (cluster and cluster.lower() in (e.clusters or []))
    ]


@overload
def unknown_name(
    kind: str, name: str, known: Iterable[str], where: str, hint: str
) -> UsageError: ...


@overload
def unknown_name(
    kind: str, name: str, known: Iterable[str], where: str, hint: str, error: type[_E]
) -> _E: ...


def unknown_name(
    kind: str,
    name: str,
    known: Iterable[str],
    where: str,
    hint: str,
    error: type[UsageError] = UsageError,
) -> UsageError:
    """The one rule for a name typed on a command line that nothing here knows.

    A usage error (exit code 2) saying what was not found where, with up to five
    close matches (difflib) or the note that there is nothing of that kind at all.
    """
    known = sorted(set(known))
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    message = f"unknown {kind} {name!r} in {where}"
    if close:
        message += f"; close matches: {', '.join(close)}"
    elif not known:
        message += f"; there are no {kind}s"
    return error(message, hint=hint)


def require_env_name(layout: InstallLayout, name: str, found: InstalledEnvs | None = None) -> None:
    """Refuse (exit code 2) an env name that is not built in ``layout``."""
    found = found if found is not None else scan_installed_envs(layout)
    if name not in found.names:
        raise unknown_name(
            "env",
            name,
            found.names,
            str(layout.root),
            "`rootstock list` shows every installed env",
            error=UnknownEnvName,
        )


def registered_env_names(layout: InstallLayout) -> list[str]:
    """Names ``install NAME --force`` can rebuild: the env files the root keeps."""
    if not layout.environments_dir.is_dir():
        return []
    return sorted(p.stem for p in layout.environments_dir.glob("*.py") if p.is_file())


def require_registered_env(layout: InstallLayout, name: str) -> None:
    """Refuse (exit code 2) ``install NAME`` when no env file of that name is registered."""
    if not layout.registered_source(name).is_file():
        raise unknown_name(
            "env",
            name,
            registered_env_names(layout),
            str(layout.root),
            "pass the path of an env file, e.g. `rootstock install environments/emt.py`",
            error=UnknownEnvName,
        )


def resolve_checkpoint(
    layout: InstallLayout, checkpoint: str, cluster: str | None = None
) -> ResolvedCheckpoint:
    """Find the env that serves ``checkpoint`` on ``cluster``.

    A ``CLUSTERS`` variant wins on the clusters it lists. Without a cluster, an id
    that only variants declare is ambiguous, and the error says which clusters. An
    id that only a broken env recorded raises :class:`EnvBroken` naming the parse
    error.
    """
    found = scan_installed_envs(layout)
    envs = found.envs
    declaring = [e for e in envs if checkpoint in e.checkpoints]
    cluster_key = cluster.lower() if cluster else None
    variants = [e for e in declaring if e.is_variant]
    universal = [e for e in declaring if not e.is_variant]
    chosen: EnvFile | None = None
    if cluster_key:
        matching = [e for e in variants if cluster_key in (e.clusters or [])]
        candidates = matching or universal
        chosen = candidates[0] if candidates else None
    elif universal:
        chosen = universal[0]
    elif variants:
        clusters = sorted({c for e in variants for c in e.clusters or []})
        raise AmbiguousCheckpoint(
            f"checkpoint {checkpoint!r} is only declared by cluster variants "
            f"(for {', '.join(clusters)})",
            hint='say which machine this is: cluster="NAME" or --cluster NAME',
        )
    if chosen is None:
        for broken in found.broken:
            if checkpoint in broken.recorded_ids:
                raise broken.error(f"checkpoint {checkpoint!r}")
        raise _not_declared(layout, checkpoint, envs_on_cluster(envs, cluster_key), cluster, found)
    return ResolvedCheckpoint(checkpoint, chosen, chosen.checkpoints[checkpoint])


def _not_declared(
    layout: InstallLayout,
    checkpoint: str,
    envs: list[EnvFile],
    cluster: str | None,
    found: InstalledEnvs,
) -> CheckpointNotDeclared:
    known = {cid for e in envs for cid in e.checkpoints}
    known.update(cid for b in found.broken for cid in b.recorded_ids)
    where = f"{layout.root}" + (f" for cluster {cluster!r}" if cluster else "")
    sample = sample_declaring(checkpoint)
    if sample is not None and sample.name not in found.names:
        path = path_to_pass(sample.path)
        return CheckpointNotDeclared(
            f"checkpoint {checkpoint!r} is declared by {path}, which is not installed in {where}",
            hint=f"rootstock install {path}",
        )
    hint = "`rootstock list` shows every installed checkpoint id"
    if found.broken:
        # A broken env's ids are unknown beyond what the manifest recorded: the id
        # may well be one of them, so say so rather than only "unknown".
        hint = "; ".join(f"env {b.name!r} is broken ({b.message})" for b in found.broken) + (
            ", and may declare it; " + hint
        )
    return unknown_name("checkpoint", checkpoint, known, where, hint, error=CheckpointNotDeclared)


def env_metadata_path(layout: InstallLayout, name: str) -> Path:
    """Build metadata written next to the env (interpreter, versions, hashes)."""
    return layout.env_dir(name) / ENV_METADATA


def read_env_metadata(layout: InstallLayout, name: str) -> dict | None:
    """The ``rootstock-env.json`` of a built env, or None if absent or unreadable."""
    try:
        data = loads_json(read_regular_file(env_metadata_path(layout, name), SMALL_FILE_MAX_BYTES))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
