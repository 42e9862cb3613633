"""``rootstock prune``'s plan: what exists minus what is declared, plus the garbage.

The planner reads the install (manifest, built envs and their generations,
``.build/`` staging, managed interpreters, registered sources, the cache root) and
the SOURCE's env files, and deletes nothing. Each entry says what goes, why, and
how many bytes deleting it frees (files with other hard links, such as the ones uv
links in from its cache, free nothing). Garbage younger than ``--min-age`` and
generations a worker runs from are reported as kept, never listed for deletion.

A SOURCE any of whose env files fails the lint refuses the whole plan: a converging
command that skipped an unreadable file would prune the env it declares.

The plan's types live in :mod:`rootstock.ops.prune_entries`, which the garbage
planner (:mod:`rootstock.ops.prune_garbage`) builds on too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from pathlib import Path

from rootstock.errors import EnvFileError, SourceError, UsageError
from rootstock.install.envfile import EnvFile, is_custom_id, parse_env_file, read_env_file
from rootstock.install.envs import InstalledEnvs, scan_installed_envs
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import resolve_cluster, served_clusters
from rootstock.install.manifest import Manifest, load_manifest
from rootstock.install.prune_journal import env_generations, freed_by, read_journal, safe_relative
from rootstock.ops.prune_entries import DeclaredSource, Listed, PruneEntry, PrunePlan, root_relative
from rootstock.ops.prune_garbage import plan_garbage, plan_uv_cache

#: ``--min-age``'s default: garbage younger than a day may belong to work in progress.
DEFAULT_MIN_AGE_S = 24 * 3600.0
RecordKey = tuple[str, str]  # (env, checkpoint id)


# --- pure rules (unit-tested) ---------------------------------------------------------


def other_clusters_served(
    clusters: list[str] | None, this_cluster: str | None, served: Iterable[str]
) -> list[str]:
    """The clusters of this install, other than this one, that a variant serves.

    Non-empty means the env is kept though SOURCE lacks it: a ``CLUSTERS`` variant
    listing only other clusters of a shared install belongs to their maintainers.
    A universal env (``clusters`` None), or a variant listing this cluster, is never
    kept by this rule. Without ``this_cluster`` (a shared install, no ``--cluster``)
    every variant serving some cluster of the install is kept.
    """
    if clusters is None:
        return []
    mine = {c.lower() for c in clusters}
    if this_cluster is not None and this_cluster.lower() in mine:
        return []
    return sorted(mine & {c.lower() for c in served})


def covers(path: str, listed: set[str]) -> bool:
    """``path`` is listed, lies under a listed directory, or holds a listed file."""
    return Listed(listed).covers(path)


def record_files(manifest: Manifest, key: RecordKey) -> list[str] | None:
    """The ``files`` of one checkpoint record (None: unattributed, or no such record)."""
    env, checkpoint = key
    entry = ((manifest.get("envs", {}).get(env) or {}).get("checkpoints") or {}).get(checkpoint)
    files = (entry or {}).get("files")
    return list(files) if isinstance(files, list) else None


def files_to_delete(
    manifest: Manifest, dropped: set[RecordKey], dropped_envs: set[str]
) -> tuple[dict[RecordKey, list[str]], dict[RecordKey, list[str]]]:
    """Reference-count attributed files: ``(deleted, shared)`` per dropped record.

    A dropped record is one in ``dropped`` or any record of an env in
    ``dropped_envs``. A file goes only if no surviving record lists it (or a
    directory above it, or a file under it); each goes once, with the first record
    that lists it. Paths that are not clean relative paths are never deleted.
    """
    surviving: set[str] = set()
    keys: set[RecordKey] = set(dropped)
    for env, record in manifest.get("envs", {}).items():
        for checkpoint, entry in (record.get("checkpoints") or {}).items():
            if env in dropped_envs or (env, checkpoint) in dropped:
                keys.add((env, checkpoint))
            else:
                surviving.update(f for f in (entry.get("files") or []) if isinstance(f, str))
    deleted: dict[RecordKey, list[str]] = {}
    shared: dict[RecordKey, list[str]] = {}
    taken: set[str] = set()
    kept = Listed(surviving)
    for key in sorted(keys):
        files = [f for f in record_files(manifest, key) or [] if isinstance(f, str)]
        shared[key] = [f for f in files if kept.covers(f)]
        deleted[key] = [
            f for f in files if f not in taken and not kept.covers(f) and safe_relative(f) == f
        ]
        taken.update(deleted[key])
    return deleted, shared


# --- reading SOURCE -------------------------------------------------------------------


def declared_envs(layout: InstallLayout, source: DeclaredSource | None) -> dict[str, EnvFile]:
    """The env files SOURCE declares, by env name, every one linted.

    None means the registered sources in ``environments/``. Raises
    :class:`SourceError` (nothing may be pruned) when any file fails the lint or
    cannot be read, when two files declare one env, or when SOURCE holds no files.
    """
    if source is not None:
        label, files = source.label, list(source.files)
    else:
        label = f"registered sources in {layout.environments_dir}"
        files = sorted(
            p
            for p in layout.environments_dir.glob("*.py")
            if p.is_file() and not p.name.startswith(".")
        )
    if not files:
        raise SourceError(
            f"{label} holds no env files, so nothing is pruned",
            hint="an empty SOURCE never means 'nothing declared'; pass the directory "
            "(or git+URL) that holds the install's env files",
        )
    found: dict[str, EnvFile] = {}
    problems: list[str] = []
    for path in files:
        try:
            env = read_env_file(path)
        except EnvFileError as exc:
            problems.append(str(exc).replace("\n", "\n    "))
            continue
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            problems.append(f"{path}: cannot be read ({exc})")
            continue
        if env.name in found:
            problems.append(f"{path}: env {env.name!r} is also declared by {found[env.name].path}")
        found[env.name] = env
    if problems:
        raise SourceError(
            f"{label}: {len(problems)} env file(s) fail the lint, so nothing is pruned:\n  "
            + "\n  ".join(problems),
            hint="fix them (`rootstock install --dry-run FILE` lints one), then prune again",
        )
    return found


# --- the planner ----------------------------------------------------------------------


def plan_prune(
    layout: InstallLayout,
    source: DeclaredSource | None,
    *,
    deep: bool = False,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    now: float | None = None,
    cluster: str | None = None,
) -> PrunePlan:
    """What ``prune`` would delete from ``layout`` to converge it to ``source``.

    ``source`` None (or a ``registered`` one) means the registered sources: envs
    without one go, but no registered file is unregistered. Raises
    :class:`SourceError` for a SOURCE that declares nothing or fails the lint, and
    :class:`~rootstock.errors.ManifestError` for a manifest or journal it cannot trust.
    """
    now = time.time() if now is None else now
    declared = declared_envs(layout, source)
    manifest = load_manifest(layout)
    this_cluster, served, note = _this_cluster(layout, manifest, cluster)
    plan = PrunePlan(
        layout.root, layout.cache_root, this_cluster, source, deep, min_age_s, cluster_arg=cluster
    )
    if note:
        plan.notes.append(note)
    explicit = source is not None and source.kind != "registered"
    installed = scan_installed_envs(layout)
    pruned = _plan_envs(layout, plan, declared, manifest, installed, explicit, this_cluster, served)
    _plan_checkpoints(layout, plan, declared, manifest, pruned)
    plan_garbage(layout, plan, manifest, pruned, now)
    journal = read_journal(layout)
    if journal:
        plan.pending_journal = True
        plan.notes.append(
            f"an interrupted prune left a journal ({len(journal.files)} files, "
            f"{len(journal.envs)} envs, {len(journal.registered)} registered files): "
            "the next prune finishes it first"
        )
    if not plan.empty:
        # Only alongside other work: a converged install is left alone.
        plan_uv_cache(layout, plan)
    return plan


def _this_cluster(
    layout: InstallLayout, manifest: Manifest, cluster: str | None
) -> tuple[str | None, list[str], str | None]:
    served = served_clusters(layout, manifest)
    try:
        return resolve_cluster(layout, cluster, manifest), served, None
    except UsageError:
        if cluster or len(served) < 2:
            if cluster:
                raise
            return None, served, None
    return (
        None,
        served,
        f"this install serves {', '.join(served)}: without --cluster, every CLUSTERS "
        "variant of any of them is kept",
    )


def _link_names(layout: InstallLayout) -> set[str]:
    with contextlib.suppress(OSError):
        return {
            p.name
            for p in layout.envs_dir.iterdir()
            if p.is_symlink() and not p.name.startswith(".")
        }
    return set()


def _plan_envs(
    layout: InstallLayout,
    plan: PrunePlan,
    declared: dict[str, EnvFile],
    manifest: Manifest,
    installed: InstalledEnvs,
    explicit: bool,
    this_cluster: str | None,
    served: list[str],
) -> set[str]:
    """List the envs SOURCE does not declare; return their names."""
    built = {e.name: e for e in installed.envs}
    names = set(installed.names) | set(manifest.get("envs", {})) | _link_names(layout)
    if explicit:
        names |= {p.stem for p in layout.environments_dir.glob("*.py") if p.is_file()}
    pruned: set[str] = set()
    for name in sorted(names - set(declared)):
        env = built.get(name) or _lenient(layout.registered_source(name), name)
        others = other_clusters_served(env.clusters if env else None, this_cluster, served)
        if others:
            why = f"a CLUSTERS variant for {', '.join(others)}: it serves other clusters here"
            plan.kept.append(PruneEntry("env", name, why, None))
            continue
        members = [layout.env_dir(name)] if layout.env_dir(name).is_symlink() else []
        members += env_generations(layout, name)
        candidates = [layout.registered_source(name)] if explicit else []
        candidates.append(layout.environments_dir / f"{name}.py.lock")
        registered = [p for p in candidates if p.is_file() or p.is_symlink()]
        records = len((manifest.get("envs", {}).get(name) or {}).get("checkpoints") or {})
        if explicit and plan.source is not None:
            why = f"not in SOURCE {plan.source.label}"
        else:
            why = "no registered source in environments/"
        what = [f"{len(members)} path(s) under envs/"] if members else []
        if name in manifest.get("envs", {}):
            what.append(f"its manifest record ({records} checkpoint record(s))")
        what += [root_relative(layout, p) for p in registered]
        plan.entries.append(
            PruneEntry(
                "env",
                name,
                f"{why}; goes: {', '.join(what) or 'nothing left'}",
                sum(freed_by(p) for p in members + registered),
                [root_relative(layout, p) for p in members + registered],
                registered=[root_relative(layout, p) for p in registered],
                members=members,
            )
        )
        pruned.add(name)
    return pruned


def _lenient(path: Path, name: str) -> EnvFile | None:
    """An env file parsed without the lint (for its CLUSTERS), or None."""
    try:
        return parse_env_file(path, name)[0] if path.is_file() else None
    except (EnvFileError, OSError, ValueError):
        return None


def _plan_checkpoints(
    layout: InstallLayout,
    plan: PrunePlan,
    declared: dict[str, EnvFile],
    manifest: Manifest,
    pruned: set[str],
) -> None:
    """Checkpoint records SOURCE no longer declares, or whose env goes, with their files."""
    dropped: dict[RecordKey, str] = {}
    for env, record in sorted(manifest.get("envs", {}).items()):
        for checkpoint in sorted(record.get("checkpoints") or {}):
            if is_custom_id(checkpoint):
                continue  # user-supplied weights: nothing of ours to delete
            if env in pruned:
                dropped[(env, checkpoint)] = f"its env {env!r} is pruned"
            elif env in declared and checkpoint not in declared[env].checkpoints:
                dropped[(env, checkpoint)] = f"no longer declared by {declared[env].path}"
    deleted, shared = files_to_delete(manifest, set(dropped), set())
    unattributed = 0
    for key, why in dropped.items():
        files = record_files(manifest, key)
        if files is None:
            unattributed += 1
            why += "; its weights are unattributed (no files recorded): --deep finds them"
        gone = deleted.get(key, [])
        if shared.get(key):
            why += f"; {len(shared[key])} file(s) shared with surviving checkpoints stay"
        plan.entries.append(
            PruneEntry(
                "checkpoint",
                key[1],
                why,
                sum(freed_by(layout.cache_root / f) for f in gone),
                gone,
                env=key[0],
                shared=shared.get(key, []),
            )
        )
    if unattributed:
        plan.notes.append(
            f"{unattributed} dropped checkpoint record(s) list no files (fetched before "
            "rootstock recorded them): their weights stay, and only --deep deletes them"
        )
