"""The ``rootstock sync`` planner: install state plus declared env files in, items out.

Pure: nothing here reads a file, runs uv or starts a worker. The caller gathers an
:class:`InstallState` once (``ops/sync.py``'s ``read_install_state``) and parses the
SOURCE's env files; :func:`check_scope` refuses the names on the command line that
SOURCE does not declare, and :func:`plan_sync` decides, for each declared env in scope:

* **build** when it is not built, when its SOURCE file differs from the source the
  env was *built* from (the ``source_hash`` in ``rootstock-env.json``), or on
  ``--rebuild`` / ``--upgrade``. A hotfixed ``env_source.py`` (the live file differs
  from its build) whose SOURCE file still equals the build brings nothing new, so
  it is not rebuilt (that would revert the hotfix): it gets a note, and a verify
  item when its verification is stale;
* **download** for each declared, non-custom id not fetched yet;
* **verify**, on this cluster and device kind, for each id never verified there,
  stale (after a rebuild or a hotfix), failed or tampered last time, whose weight
  files changed size or mtime since ``add`` (or that a worker start marked), or
  planned to be fetched or rebuilt by this very sync.

What it will not act on becomes a note: drifted checkpoints (they need ``add
--accept-drift``), envs built by another rootstock version, variants that do not
serve this cluster, broken envs, work a deselected phase would have done.

Items come in phase order (build, download, verify), so an env's build always comes
before its downloads and verifies, which depend on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import CheckpointNotDeclared, UnknownEnvName, UsageError
from rootstock.install.envfile import EnvFile, LintProblem, is_custom_id
from rootstock.install.envs import unknown_name
from rootstock.install.manifest import Manifest, checkpoint_state

PHASES: tuple[str, ...] = ("build", "download", "verify")
"""Every phase, in the order a sync runs them."""

# How each reason reads in the plan (and in ``--json``: ``reason``).
NOT_BUILT = "not built"
SOURCE_DIFFERS = "source differs from the build (source_hash)"
NO_BUILD_RECORD = "no build record (rootstock-env.json)"
REBUILD = "--rebuild"
UPGRADE = "--upgrade"
LINT_FAILED = "fails the install lint"
NOT_FETCHED = "declared, not fetched"
NEVER_VERIFIED = "never verified"
NEWLY_FETCHED = "newly fetched"
NEWLY_BUILT = "env rebuilt by this sync"
WEIGHTS_CHANGED = "weight files changed since add (size or mtime)"


@dataclass(frozen=True)
class BuiltEnv:
    """One built env as the reader found it (``envs/<name>``).

    ``built_source_hash`` is the hash of the source it was built from (None: no
    build metadata); ``live_source_hash`` the hash of its ``env_source.py`` now.
    ``broken`` is the ``file:line: reason`` of an ``env_source.py`` that does not
    parse (then ``checkpoints`` are the ids the manifest recorded for it).
    """

    name: str
    built_source_hash: str | None
    live_source_hash: str | None
    checkpoints: tuple[str, ...] = ()
    clusters: tuple[str, ...] | None = None
    rootstock: str | None = None
    broken: str | None = None

    @property
    def hotfixed(self) -> bool:
        """True when the live ``env_source.py`` differs from the one it was built from."""
        return bool(
            self.built_source_hash
            and self.live_source_hash
            and self.live_source_hash != self.built_source_hash
        )


@dataclass(frozen=True)
class RejectedFile:
    """A SOURCE env file that fails the install lint: a failed build, nothing more."""

    name: str
    path: Path
    problems: tuple[LintProblem, ...]


@dataclass(frozen=True)
class InstallState:
    """A snapshot of everything the planner looks at, read once.

    ``cluster`` is None when no cluster could be named (a shared install and no
    ``--cluster``: only allowed when the verify phase is not selected).
    ``weights_changed`` holds the ``(env, id)`` of checkpoints whose recorded weight
    files changed size or mtime, or that a worker start marked for re-verification.
    """

    manifest: Manifest
    envs: Mapping[str, BuiltEnv]
    cluster: str | None
    device_kind: str
    rootstock_version: str
    pending_prune: bool = False
    weights_changed: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class SyncOptions:
    """What the command line scoped the plan to."""

    phases: tuple[str, ...] = PHASES
    envs: frozenset[str] = frozenset()
    checkpoints: frozenset[str] = frozenset()
    rebuild: bool = False
    upgrade: bool = False


@dataclass(frozen=True)
class PlanItem:
    """One thing a sync will do: ``phase`` of ``env`` (and ``checkpoint``), and why.

    ``blocked`` holds the lint problems of a build that cannot start (its file fails
    the install lint): it is reported failed without running uv.
    """

    phase: str
    env: str
    checkpoint: str | None
    reason: str
    path: Path | None = None
    force: bool = False
    blocked: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """``env`` or ``env/checkpoint``: how the item is named in every line."""
        return f"{self.env}/{self.checkpoint}" if self.checkpoint else self.env

    @property
    def symbol(self) -> str:
        """The dry run's mark: ``+`` adds something, ``~`` redoes it, ``!`` cannot run."""
        if self.blocked:
            return "!"
        if self.phase == "download" or (self.phase == "build" and self.reason == NOT_BUILT):
            return "+"
        return "~"

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``plan.items`` in ``sync --json`` (docs/cli.md)."""
        return {
            "phase": self.phase,
            "env": self.env,
            "checkpoint": self.checkpoint,
            "reason": self.reason,
            "path": str(self.path) if self.path else None,
            "blocked": list(self.blocked),
        }


@dataclass
class SyncPlan:
    """Every item of a sync in run order, and the notes on what it leaves alone."""

    items: list[PlanItem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Items per phase (every phase named, zeros included)."""
        return {phase: sum(i.phase == phase for i in self.items) for phase in PHASES}

    def phase_items(self, phase: str) -> list[PlanItem]:
        """The items of one phase, in plan order."""
        return [i for i in self.items if i.phase == phase]

    def to_dict(self) -> dict[str, Any]:
        """``plan`` in ``sync --json``: ``items``, ``notes`` and ``counts``."""
        return {
            "items": [i.to_dict() for i in self.items],
            "notes": list(self.notes),
            "counts": self.counts(),
        }


@dataclass(frozen=True)
class _Target:
    """An env as it will be once the build phase has run: the ids and clusters it serves."""

    name: str
    checkpoints: tuple[str, ...]
    clusters: tuple[str, ...] | None

    def serves(self, checkpoint: str, cluster: str | None, variants: set[tuple[str, str]]) -> bool:
        # The rule of ops/status.serves_on: a variant serves its clusters only, and a
        # universal id is shadowed where a variant declares it.
        if cluster is None:
            return True
        if self.clusters is not None:
            return cluster in self.clusters
        return (cluster, checkpoint) not in variants


def public_version(version: str | None) -> str | None:
    """``0.1.0+h1234`` -> ``0.1.0``: the vendored wheel's local label is a content hash."""
    return version.split("+", 1)[0] if version else None


def plan_sync(
    state: InstallState,
    declared: Sequence[EnvFile],
    options: SyncOptions,
    rejected: Sequence[RejectedFile] = (),
) -> SyncPlan:
    """Plan a sync of ``state`` to the env files ``declared`` (see the module docstring).

    ``rejected`` are SOURCE files that fail the install lint: each becomes a blocked
    build item (reported failed, nothing else of that env is planned). Names in
    ``options.envs`` / ``options.checkpoints`` are assumed checked by the caller.
    """
    plan = SyncPlan()
    phases = set(options.phases)
    if state.pending_prune:
        plan.notes.append("an interrupted prune left a journal: sync finishes its deletions first")
    scoped = [env for env in declared if _in_scope(env, state, options)]
    for bad in rejected:
        if (not options.envs or bad.name in options.envs) and not options.checkpoints:
            if "build" in phases:
                plan.items.append(
                    PlanItem(
                        "build",
                        bad.name,
                        None,
                        LINT_FAILED,
                        bad.path,
                        blocked=tuple(str(p) for p in bad.problems),
                    )
                )
            else:
                plan.notes.append(f"{bad.name}: {bad.path} fails the install lint")
    targets: dict[str, _Target] = {
        name: _Target(name, built.checkpoints, built.clusters) for name, built in state.envs.items()
    }
    rebuilt: set[str] = set()
    usable: dict[str, bool] = {}
    for env in scoped:
        built = state.envs.get(env.name)
        reason = _build_reason(env, built, options)
        if reason is not None and "build" in phases:
            plan.items.append(
                PlanItem("build", env.name, None, reason, env.path, built is not None)
            )
            rebuilt.add(env.name)
            targets[env.name] = _Target(
                env.name,
                tuple(env.checkpoints),
                tuple(env.clusters) if env.clusters is not None else None,
            )
            usable[env.name] = True
            continue
        usable[env.name] = built is not None and built.broken is None
        if built is None:
            plan.notes.append(f"{env.name}: not built, and the build phase is not selected")
        elif built.broken is not None:
            plan.notes.append(
                f"{env.name}: broken ({built.broken}); not rebuilt, its source is unchanged: "
                f"fix the hotfix, or pass --rebuild --env {env.name}"
            )
        elif reason is not None:
            plan.notes.append(
                f"{env.name}: {reason}; not rebuilt (the build phase is not selected)"
            )
        elif built.hotfixed:
            plan.notes.append(
                f"{env.name}: hotfixed; not rebuilt (envs/{env.name}/env_source.py differs from "
                "its build, and SOURCE brings nothing new; --rebuild would revert the hotfix)"
            )
        if built is not None and built.broken is None and reason is None:
            _version_note(plan, built, state.rootstock_version)
    variants = {
        (cluster, cid)
        for target in targets.values()
        if target.clusters is not None
        for cluster in target.clusters
        for cid in target.checkpoints
    }
    downloads: list[PlanItem] = []
    verifies: list[PlanItem] = []
    for env in scoped:
        if not usable.get(env.name):
            continue
        target = targets[env.name]
        if (
            state.cluster is not None
            and target.clusters is not None
            and state.cluster not in target.clusters
        ):
            plan.notes.append(
                f"{env.name}: a variant for {', '.join(target.clusters)}, not {state.cluster}: "
                "its checkpoints are downloaded and verified from those clusters"
            )
            continue
        _plan_checkpoints(
            plan, state, options, target, env.name in rebuilt, variants, phases, downloads, verifies
        )
    plan.items.extend(downloads)
    plan.items.extend(verifies)
    return plan


def check_scope(
    declared: Sequence[EnvFile],
    rejected: Sequence[RejectedFile],
    state: InstallState,
    options: SyncOptions,
    where: str,
) -> None:
    """Refuse (exit code 2, with close matches) an ``--env`` or ``--checkpoint`` SOURCE
    does not declare, a ``:custom`` id, and an id of another env than ``--env``."""
    names = {e.name for e in declared} | {r.name for r in rejected}
    for name in sorted(options.envs):
        if name not in names:
            raise unknown_name(
                "env",
                name,
                names,
                where,
                "sync acts only on the envs its SOURCE declares (one env file each)",
                error=UnknownEnvName,
            )
    owners: dict[str, str] = {}
    for env in declared:
        built = state.envs.get(env.name)
        for checkpoint in [*env.checkpoints, *(built.checkpoints if built else ())]:
            owners.setdefault(checkpoint, env.name)
    for checkpoint in sorted(options.checkpoints):
        if checkpoint not in owners:
            raise unknown_name(
                "checkpoint",
                checkpoint,
                owners,
                where,
                "the CHECKPOINTS tables of SOURCE's env files name every id sync can act on",
                error=CheckpointNotDeclared,
            )
        if is_custom_id(checkpoint):
            raise UsageError(
                f"{checkpoint!r} takes user-supplied weights; sync never downloads or verifies it",
                hint="pick a registered checkpoint id",
            )
        if options.envs and owners[checkpoint] not in options.envs:
            raise UsageError(
                f"checkpoint {checkpoint!r} is declared by env {owners[checkpoint]!r}, "
                f"not by {', '.join(sorted(options.envs))}",
                hint=f"drop --env, or add --env {owners[checkpoint]}",
            )


def _in_scope(env: EnvFile, state: InstallState, options: SyncOptions) -> bool:
    if options.envs and env.name not in options.envs:
        return False
    if not options.checkpoints:
        return True
    built = state.envs.get(env.name)
    ids = set(env.checkpoints) | set(built.checkpoints if built else ())
    return bool(ids & options.checkpoints)


def _build_reason(env: EnvFile, built: BuiltEnv | None, options: SyncOptions) -> str | None:
    if built is None:
        return NOT_BUILT
    if built.built_source_hash is None:
        return NO_BUILD_RECORD
    if env.source_hash != built.built_source_hash:
        return SOURCE_DIFFERS
    if options.upgrade:
        return UPGRADE
    if options.rebuild:
        return REBUILD
    return None


def _version_note(plan: SyncPlan, built: BuiltEnv, current: str) -> None:
    theirs = public_version(built.rootstock)
    ours = public_version(current)
    if theirs and ours and theirs != ours:
        plan.notes.append(
            f"{built.name}: built by rootstock {theirs}, this is {ours}; "
            f"--rebuild --env {built.name} rebuilds it with this version"
        )


def _plan_checkpoints(
    plan: SyncPlan,
    state: InstallState,
    options: SyncOptions,
    target: _Target,
    rebuilt: bool,
    variants: set[tuple[str, str]],
    phases: set[str],
    downloads: list[PlanItem],
    verifies: list[PlanItem],
) -> None:
    """The download and verify items of one env that will be usable after the builds."""
    manifest = state.manifest
    recorded = (manifest.get("envs", {}).get(target.name) or {}).get("checkpoints") or {}
    built = state.envs.get(target.name)
    live_hash = built.live_source_hash if built and not rebuilt else None
    unfetched: list[str] = []
    drifted: list[str] = []
    for checkpoint in _selected(target.checkpoints, options.checkpoints):
        if is_custom_id(checkpoint) or not target.serves(checkpoint, state.cluster, variants):
            continue
        fetched = bool((recorded.get(checkpoint) or {}).get("fetched_at"))
        downloading = False
        if not fetched:
            if "download" not in phases:
                unfetched.append(checkpoint)
                continue
            downloads.append(PlanItem("download", target.name, checkpoint, NOT_FETCHED))
            downloading = True
        if "verify" not in phases or state.cluster is None:
            continue
        if downloading:
            verifies.append(PlanItem("verify", target.name, checkpoint, NEWLY_FETCHED))
            continue
        if rebuilt:
            verifies.append(PlanItem("verify", target.name, checkpoint, NEWLY_BUILT))
            continue
        cell = checkpoint_state(
            manifest,
            target.name,
            checkpoint,
            state.cluster,
            device_kind=state.device_kind,
            current_source_hash=live_hash,
        )
        reason = _verify_reason(cell.state, cell.message, state)
        if reason is None and (target.name, checkpoint) in state.weights_changed:
            reason = WEIGHTS_CHANGED
        if reason is not None:
            verifies.append(PlanItem("verify", target.name, checkpoint, reason))
        elif cell.state == "drifted":
            drifted.append(checkpoint)
    if unfetched:
        plan.notes.append(
            f"{target.name}: {len(unfetched)} checkpoint(s) not fetched "
            f"({', '.join(unfetched)}), and the download phase is not selected"
        )
    for checkpoint in drifted:
        plan.notes.append(
            f"{target.name}/{checkpoint}: drifted on {state.cluster} ({state.device_kind}); "
            f"accept it with `rootstock add {checkpoint} --accept-drift`, or investigate"
        )


def _verify_reason(shown: str, message: str | None, state: InstallState) -> str | None:
    where = f"on {state.cluster} ({state.device_kind})"
    if shown == "fetched":
        return f"{NEVER_VERIFIED} {where}"
    if shown == "stale":
        return f"stale: {message}" if message else "stale"
    if shown in ("failed", "tampered"):
        return f"{shown} last time: {message}" if message else f"{shown} last time"
    return None


def _selected(ids: Iterable[str], wanted: frozenset[str]) -> list[str]:
    return [cid for cid in ids if not wanted or cid in wanted]
