"""``rootstock install``: lint, lock, build and register env files."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import EnvFileError, EnvNotFound, LockTimeout, RootstockError
from rootstock.install import Reporter
from rootstock.install.atomic import atomic_write_text
from rootstock.install.build import (
    BuildOptions,
    activate,
    build_env,
    claim_stale_staging,
    discard_build,
    env_build_lock,
    remove_claimed,
    root_lock,
)
from rootstock.install.dry_run import InstallPlan, plan_files
from rootstock.install.envfile import EnvFile, id_conflicts, read_env_file
from rootstock.install.envs import installed_env_names, load_installed_envs, read_env_metadata
from rootstock.install.interpreters import (
    Interpreter,
    choose_interpreter,
    probe_interpreter,
)
from rootstock.install.layout import InstallLayout, read_layout, write_layout
from rootstock.install.perms import maintainer_umask
from rootstock.install.sharing import root_is_shared


@dataclass
class InstallOutcome:
    """The result of installing one env file."""

    name: str
    status: str  # "built", "unchanged" or "failed"
    env_dir: Path | None = None
    interpreter: dict[str, Any] | None = None
    versions: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    error: RootstockError | None = None
    #: What the lint noticed but does not refuse (``FILE:LINE: message (fix: ...)``).
    warnings: list[str] = field(default_factory=list)
    #: Notes already given to the ``step`` reporter as they happened (the
    #: interpreter's): part of the outcome, but a renderer need not repeat them.
    reported: list[str] = field(default_factory=list)

    @property
    def all_notes(self) -> list[str]:
        """The reported notes, then the others."""
        return [*self.reported, *self.notes]

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``install --json``."""
        return {
            "name": self.name,
            "status": self.status,
            "env_dir": str(self.env_dir) if self.env_dir else None,
            "interpreter": self.interpreter,
            "versions": self.versions,
            "notes": self.all_notes,
            "warnings": self.warnings,
            "error": str(self.error) if self.error else None,
        }


def expand_targets(layout: InstallLayout | None, target: str) -> list[Path]:
    """Turn a file, a directory or a registered env name into env-file paths.

    Without a layout (a dry run with no install root) only files and directories
    can be named.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.glob("*.py") if p.is_file())
        if not files:
            raise EnvFileError(f"{path} contains no *.py env files")
        return files
    if path.is_file():
        return [path]
    if path.suffix == ".py" or os.sep in target:
        raise EnvFileError(f"env file {path} does not exist")
    if layout is None:
        raise EnvNotFound(
            f"{target!r} is not a file, and no install root is given to look it up in",
            hint="pass --root (or --cluster) to name a registered env, or give a file path",
        )
    registered = layout.registered_source(target)
    if registered.is_file():
        return [registered]
    raise EnvNotFound(
        f"{target!r} is neither a file nor a registered env in {layout.root}",
        hint="pass the path of an env file, e.g. `rootstock install environments/emt.py`",
    )


def install(
    layout: InstallLayout,
    target: str,
    *,
    force: bool = False,
    options: BuildOptions | None = None,
    python: str | None = None,
    cluster: str | None = None,
    step: Reporter = lambda _msg: None,
) -> list[InstallOutcome]:
    """Install every env file ``target`` names; one outcome per file.

    A directory installs each file in turn and keeps going past failures; a single
    file raises its error instead.
    """
    options = options or BuildOptions()
    paths = expand_targets(layout, target)
    outcomes: list[InstallOutcome] = []
    with maintainer_umask():
        _prepare_root(layout, cluster)
        sweep_stale_staging(layout)
        for path in paths:
            try:
                outcomes.append(install_one(layout, path, force, options, python, step))
            except RootstockError as exc:
                if len(paths) == 1:
                    raise
                outcomes.append(InstallOutcome(path.stem, "failed", error=exc))
    return outcomes


def plan_install(
    layout: InstallLayout | None,
    target: str,
    *,
    force: bool = False,
    upgrade: bool = False,
    python: str | None = None,
    cluster: str | None = None,
) -> InstallPlan:
    """What ``install(layout, target, ...)`` would do, without uv and without writing.

    ``layout`` is None when no install root could be resolved: then only the lint
    runs. A root that does not exist yet is planned as empty (every file would be
    built, ids are checked only among the files themselves), with a note that
    ``init`` comes first.
    """
    from rootstock.install.manifest import load_manifest

    paths = expand_targets(layout, target)
    plan = InstallPlan(
        root=layout.root if layout else None,
        root_exists=bool(layout and layout.root.is_dir()),
        cache_root=layout.cache_root if layout else None,
        cluster=cluster,
    )
    if layout is None:
        plan.notes.append(
            "no install root given: only the lint ran "
            "(pass --root or --cluster to compare with an install)"
        )
    elif not plan.root_exists:
        plan.notes.append(
            f"install root {layout.root} does not exist yet: run `rootstock init --root "
            f"{layout.root}` before installing; ids were checked only among these files"
        )
    else:
        # The real install refuses an untrusted manifest before building; so does this.
        load_manifest(layout)
        if read_layout(layout.root) is None:
            plan.notes.append(f"would record layout.json declaring cache root {layout.cache_root}")
        if not layout.manifest_file.exists():
            plan.notes.append("would create manifest.json (the root has none)")
    plan.envs, warnings = plan_files(layout, paths, force=force, upgrade=upgrade, python=python)
    plan.notes.extend(warnings)
    return plan


def _prepare_root(layout: InstallLayout, cluster: str | None) -> None:
    from rootstock.install.manifest import load_manifest

    # Refuse an untrusted manifest before building: a build swapped in but never
    # recorded would leave the old verifications looking current (not stale).
    load_manifest(layout)
    for directory in (
        layout.environments_dir,
        layout.envs_dir,
        layout.locks_dir,
        layout.home_dir,
        layout.cache_dir,
    ):
        directory.mkdir(parents=True, exist_ok=True)
    if read_layout(layout.root) is None:
        # Record the missing declaration; never change an existing one (only init may).
        with root_lock(layout):
            if read_layout(layout.root) is None:
                cache = None if layout.cache_root == layout.root else layout.cache_root
                write_layout(layout.root, cache)
    if not layout.manifest_file.exists():
        # Every install has a manifest, even on a root that `init` never saw.
        from rootstock.install.machine import suggest_cluster
        from rootstock.install.manifest import ensure_manifest

        ensure_manifest(layout, [cluster or suggest_cluster(layout.root)])


def sweep_stale_staging(layout: InstallLayout) -> list[Path]:
    """Remove the ``.build/`` leftovers of killed builds; return the paths removed.

    The claim runs under the root lock, so two installs never judge the same entry
    at once; the slow deletion runs after it is released.
    """
    with root_lock(layout):
        claimed = claim_stale_staging(layout)
    remove_claimed(claimed)
    return claimed


def install_one(
    layout: InstallLayout,
    path: Path,
    force: bool,
    options: BuildOptions,
    python: str | None,
    step: Reporter,
) -> InstallOutcome:
    """Lint, build and register one env file."""
    env = read_env_file(path)
    name = env.name
    warnings = [str(w) for w in env.warnings]
    registered = layout.registered_source(name)
    installed = name in installed_env_names(layout)
    if installed and not force:
        same = registered.is_file() and registered.read_text() == env.source
        if same:
            return InstallOutcome(
                name,
                "unchanged",
                layout.env_dir(name),
                notes=[f"{name} is already installed; pass --force to rebuild"],
                warnings=warnings,
            )
        raise EnvFileError(
            f"env {name!r} is already installed from a different source",
            hint=f"pass --force to rebuild it from {path}",
        )
    env_lock = env_build_lock(layout, name)
    if not env_lock.acquire(blocking=False):
        holder = env_lock.holder()
        raise LockTimeout(
            f"another `rootstock install` of {name!r} is running"
            + (f" ({holder})" if holder else ""),
            hint="wait for it to finish, then retry",
        )
    try:
        with root_lock(layout):
            _check_conflicts(layout, env)
        step(f"{name}: choosing the interpreter")
        choice = _interpreter_for(layout, env, python, options.verbose, force)
        for note in choice[1]:
            step(f"{name}: {note}")
        lock_file = layout.environments_dir / f"{name}.py.lock"
        previous_lock = lock_file.read_text() if lock_file.is_file() else None
        result = build_env(
            layout, env, choice[0], options, previous_lock, lambda msg: step(f"{name}: {msg}")
        )
        step(f"{name}: registering")
        try:
            with root_lock(layout):
                _check_conflicts(layout, env)
                atomic_write_text(registered, env.source)
                if result.lock_text is not None:
                    atomic_write_text(lock_file, result.lock_text)
                activate(layout, result)
                _record_build(layout, name, result.metadata)
        finally:
            # A build refused at registration leaves no staging behind either.
            discard_build(result)
    finally:
        env_lock.release()
    return InstallOutcome(
        name,
        "built",
        layout.env_dir(name),
        result.metadata["interpreter"],
        result.metadata["versions"],
        notes=result.warnings,
        reported=choice[1],
        warnings=warnings,
    )


def _check_conflicts(layout: InstallLayout, env: EnvFile) -> None:
    installed, _ = load_installed_envs(layout)
    problems = id_conflicts(env, installed)
    if problems:
        raise EnvFileError(f"{env.path} declares checkpoint ids that are already taken", problems)


def _interpreter_for(
    layout: InstallLayout, env: EnvFile, python: str | None, verbose: bool, rebuild: bool
) -> tuple[Interpreter, list[str]]:
    if not python and rebuild:
        recorded = (read_env_metadata(layout, env.name) or {}).get("interpreter") or {}
        if recorded.get("path") and Path(recorded["path"]).exists():
            interp = probe_interpreter(recorded["path"], "recorded")
            from packaging.specifiers import SpecifierSet

            if interp and SpecifierSet(env.requires_python or "").contains(
                interp.version, prereleases=True
            ):
                return interp, [f"reusing the recorded interpreter {interp.path}"]
    choice = choose_interpreter(
        layout, env.requires_python, str(env.path), python, verbose, root_is_shared(layout)
    )
    return choice.interpreter, choice.notes


def _record_build(layout: InstallLayout, name: str, metadata: dict[str, Any]) -> None:
    from rootstock.install.manifest import record_env_build

    versions = metadata.get("versions") or {}
    record_env_build(
        layout,
        name,
        {
            "source_hash": metadata["source_hash"],
            "lock_hash": metadata.get("lock_hash"),
            "built_at": metadata["built_at"],
            "build_id": metadata["build_id"],
            "python": versions.get("python"),
            "python_path": (metadata.get("interpreter") or {}).get("path"),
            "torch": versions.get("torch"),
            "rootstock": versions.get("rootstock"),
            "image": metadata.get("image"),
        },
    )
