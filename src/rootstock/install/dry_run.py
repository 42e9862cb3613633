"""What ``rootstock install`` would do, worked out without building or writing.

The plan reads env files with ``ast`` (as the install lint does) and reads the
install root (installed envs, registered sources, lockfiles, build metadata), but
never runs uv and never writes: no manifest, no ``layout.json``, no directories.
``rootstock install --dry-run`` renders it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import EnvFileError
from rootstock.install.envfile import EnvFile, LintProblem, id_conflicts, parse_env_file
from rootstock.install.envs import installed_env_names, load_installed_envs, read_env_metadata
from rootstock.install.layout import InstallLayout

# What the real install would do with one file.
BUILD = "build"  # not installed yet: lock, build, register
REBUILD = "rebuild"  # installed, and --force (or --upgrade) asks for a rebuild
UNCHANGED = "unchanged"  # installed from this very source: nothing to do
BLOCKED = "blocked"  # the install would fail: lint, id conflict, or a changed source
ACTIONS = (BUILD, REBUILD, UNCHANGED, BLOCKED)


@dataclass(frozen=True)
class Shadowed:
    """A universal env's checkpoint id that a ``CLUSTERS`` variant overrides."""

    checkpoint: str
    env: str

    def to_dict(self) -> dict[str, str]:
        return {"checkpoint": self.checkpoint, "env": self.env}


@dataclass
class EnvPlan:
    """What installing one env file would do, and what the file declares."""

    name: str
    path: Path
    action: str
    reason: str
    requires_python: str | None = None
    dependencies: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    clusters: list[str] | None = None
    tool_uv: dict[str, Any] = field(default_factory=dict)
    source_hash: str | None = None
    resolution: str | None = None  # "lockfile", "upgrade" or "fresh"; None if not built
    lockfile: Path | None = None
    interpreter: str | None = None
    shadows: list[Shadowed] = field(default_factory=list)
    problems: list[LintProblem] = field(default_factory=list)
    warnings: list[LintProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.action != BLOCKED

    def to_dict(self) -> dict[str, Any]:
        """The documented ``install --dry-run --json`` shape of one env."""
        return {
            "name": self.name,
            "path": str(self.path),
            "action": self.action,
            "reason": self.reason,
            "requires_python": self.requires_python,
            "dependencies": self.dependencies,
            "checkpoints": self.checkpoints,
            "clusters": self.clusters,
            "tool_uv": self.tool_uv,
            "source_hash": self.source_hash,
            "resolution": self.resolution,
            "lockfile": str(self.lockfile) if self.lockfile else None,
            "interpreter": self.interpreter,
            "shadows": [s.to_dict() for s in self.shadows],
            "problems": [_problem_dict(p) for p in self.problems],
            "warnings": [_problem_dict(w) for w in self.warnings],
        }


def _problem_dict(problem: LintProblem) -> dict[str, Any]:
    """One lint problem or warning as the ``install --dry-run --json`` document gives it."""
    return {
        "path": str(problem.path),
        "line": problem.line,
        "message": problem.message,
        "fix": problem.fix,
    }


@dataclass
class InstallPlan:
    """The whole dry run: where it would install, and one :class:`EnvPlan` per file."""

    root: Path | None
    root_exists: bool
    cache_root: Path | None
    cluster: str | None
    envs: list[EnvPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(env.ok for env in self.envs)

    def to_dict(self) -> dict[str, Any]:
        """The documented ``install --dry-run --json`` document."""
        return {
            "dry_run": True,
            "ok": self.ok,
            "root": str(self.root) if self.root else None,
            "root_exists": self.root_exists,
            "cache_root": str(self.cache_root) if self.cache_root else None,
            "cluster": self.cluster,
            "notes": self.notes,
            "envs": [env.to_dict() for env in self.envs],
        }


def read_for_plan(path: Path) -> tuple[EnvFile | None, list[LintProblem]]:
    """Parse and lint ``path``; an unreadable file is one problem, not an exception."""
    try:
        return parse_env_file(path)
    except EnvFileError as exc:
        return None, [LintProblem(path, 1, exc.message, exc.hint or "check the file")]


def plan_env(
    layout: InstallLayout | None,
    path: Path,
    installed: list[EnvFile],
    *,
    force: bool = False,
    upgrade: bool = False,
    python: str | None = None,
) -> tuple[EnvPlan, EnvFile | None]:
    """Plan one file against ``installed`` (the envs live when it would run).

    Returns the plan and the parsed file, which the caller adds to ``installed``
    when it would be built, so that later files of the same run see it (a real
    install of a directory registers each file before the next one).
    """
    env, problems = read_for_plan(path)
    if env is None:
        return EnvPlan(path.stem, path, BLOCKED, "the file cannot be read", problems=problems), None
    plan = EnvPlan(
        name=env.name,
        path=path,
        action=BUILD,
        reason="",
        requires_python=env.requires_python,
        dependencies=list(env.dependencies),
        checkpoints=env.declared_ids(),
        clusters=env.clusters,
        tool_uv=dict((env.script_metadata.get("tool") or {}).get("uv") or {}),
        source_hash=env.source_hash,
        problems=list(problems),
        warnings=list(env.warnings),
    )
    if problems:
        plan.action, plan.reason = BLOCKED, "the file fails the install lint"
        return plan, None
    names = {e.name for e in installed}
    is_installed = env.name in names or (
        layout is not None and env.name in installed_env_names(layout)
    )
    force = force or upgrade
    if is_installed and not force:
        registered = layout.registered_source(env.name) if layout else None
        if registered is not None and registered.is_file() and registered.read_text() == env.source:
            plan.action = UNCHANGED
            plan.reason = "already installed from this source; pass --force to rebuild"
            return plan, None
        plan.action = BLOCKED
        plan.reason = "already installed from a different source; pass --force to rebuild"
        plan.problems.append(
            LintProblem(
                path,
                1,
                f"env {env.name!r} is already installed from a different source",
                f"pass --force to rebuild it from {path}",
            )
        )
        return plan, None
    others = [e for e in installed if e.name != env.name]
    conflicts = id_conflicts(env, others)
    if conflicts:
        plan.action, plan.reason = BLOCKED, "its checkpoint ids are already taken"
        plan.problems.extend(conflicts)
        return plan, None
    plan.shadows = _shadowed(env, others)
    if is_installed:
        plan.action, plan.reason = REBUILD, "installed; --force rebuilds it"
    else:
        plan.action, plan.reason = BUILD, "not installed yet"
    _describe_build(plan, layout, env, is_installed, upgrade, python)
    return plan, env


def _describe_build(
    plan: EnvPlan,
    layout: InstallLayout | None,
    env: EnvFile,
    is_installed: bool,
    upgrade: bool,
    python: str | None,
) -> None:
    """Fill in how the build would resolve and which interpreter it would start from."""
    lock = layout.environments_dir / f"{env.name}.py.lock" if layout else None
    if upgrade:
        plan.resolution = "upgrade"
    elif lock is not None and lock.is_file():
        plan.resolution, plan.lockfile = "lockfile", lock
    else:
        plan.resolution = "fresh"
    if python:
        plan.interpreter = python
    elif is_installed and layout is not None:
        recorded = (read_env_metadata(layout, env.name) or {}).get("interpreter") or {}
        plan.interpreter = recorded.get("path")


def _shadowed(env: EnvFile, others: list[EnvFile]) -> list[Shadowed]:
    if not env.is_variant:
        return []
    return [
        Shadowed(cid, other.name)
        for other in others
        if not other.is_variant
        for cid in env.declared_ids()
        if cid in other.checkpoints
    ]


def plan_files(
    layout: InstallLayout | None,
    paths: list[Path],
    *,
    force: bool = False,
    upgrade: bool = False,
    python: str | None = None,
) -> tuple[list[EnvPlan], list[str]]:
    """Plan ``paths`` in order, as one install run would take them; plus warnings."""
    installed: list[EnvFile] = []
    warnings: list[str] = []
    if layout is not None and layout.root.is_dir():
        installed, warnings = load_installed_envs(layout)
    plans = []
    for path in paths:
        plan, env = plan_env(layout, path, installed, force=force, upgrade=upgrade, python=python)
        plans.append(plan)
        if env is not None:
            installed = [e for e in installed if e.name != env.name] + [env]
    return plans, warnings
