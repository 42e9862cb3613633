"""The garbage half of ``rootstock prune``'s plan (:mod:`rootstock.ops.prune_plan`).

Garbage is what no declaration names and nothing uses: stale ``.build/`` staging,
old env generations no worker holds, managed interpreters no env uses, lockfiles
without their env file, unused entries of uv's cache and (listed only with
``--deep``) content under ``cache/`` and ``home/`` that no checkpoint record lists.
Everything but uv's cache must be older than ``--min-age``; what is younger, or in
use, is reported as kept.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path, PurePosixPath

from rootstock.install.build import stale_staging_groups
from rootstock.install.envs import ENV_METADATA
from rootstock.install.generations import claim_generation, locks_are_coherent
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import Manifest
from rootstock.install.parsing import loads_json
from rootstock.install.prune_journal import freed_by
from rootstock.ops.prune_entries import Listed, PruneEntry, PrunePlan, old_enough, root_relative


def plan_garbage(
    layout: InstallLayout, plan: PrunePlan, manifest: Manifest, pruned: set[str], now: float
) -> None:
    """Add the garbage entries (and what is kept) to ``plan``; ``pruned``: envs that go."""
    _plan_staging(layout, plan, now)
    _plan_generations(layout, plan, pruned, now)
    _plan_interpreters(layout, plan, manifest, now)
    _plan_lockfiles(layout, plan, pruned, now)
    _plan_unattributed(layout, plan, manifest, now)


def plan_uv_cache(layout: InstallLayout, plan: PrunePlan) -> None:
    """Add ``uv cache prune`` as one entry (its bytes are known only once it ran)."""
    cache = layout.uv_cache_dir
    if not cache.is_dir():
        return
    where = ""
    if cache.is_symlink():
        where = f" (a link to {os.path.realpath(cache)}: pruned for all its users)"
    plan.entries.append(
        PruneEntry(
            "uv-cache",
            root_relative(layout, cache),
            f"`uv cache prune`: entries of uv's cache no build uses{where}",
            None,
            [root_relative(layout, cache)],
        )
    )


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _young(plan: PrunePlan, entry: PruneEntry, mtime: float, now: float) -> bool:
    """File ``entry`` as kept when it is younger than --min-age; True if it was."""
    if old_enough(mtime, now, plan.min_age_s):
        return False
    entry.reason = f"younger than --min-age ({_age(now - mtime)} old): {entry.reason}"
    plan.kept.append(entry)
    return True


def _age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _plan_staging(layout: InstallLayout, plan: PrunePlan, now: float) -> None:
    for base, members in sorted(stale_staging_groups(layout).items()):
        entry = PruneEntry(
            "staging",
            f".build/{base}",
            "the staging of a build that is over (its owner is gone)",
            sum(freed_by(m) for m in members),
            [root_relative(layout, m) for m in sorted(members)],
            members=sorted(members),
        )
        if not _young(plan, entry, max(_mtime(m) for m in members), now):
            plan.entries.append(entry)


def generation_dirs(layout: InstallLayout) -> dict[str, list[Path]]:
    """Every generation directory under ``envs/``, by env name (orphans included)."""
    found: dict[str, list[Path]] = {}
    with contextlib.suppress(OSError):
        for entry in layout.envs_dir.iterdir():
            if not entry.name.startswith(".") or entry.is_symlink() or not entry.is_dir():
                continue
            name, dot, build = entry.name[1:].rpartition(".")
            if dot and name and not build.startswith("link-"):
                found.setdefault(name, []).append(entry)
    return {name: sorted(paths) for name, paths in found.items()}


def _plan_generations(layout: InstallLayout, plan: PrunePlan, pruned: set[str], now: float) -> None:
    """Generations no ``envs/<n>`` link points at, unless a worker holds them."""
    coherence = locks_are_coherent(layout.envs_dir)
    if not coherence.coherent:
        plan.notes.append(
            f"generation locks are not coherent across nodes here ({coherence.reason}): "
            "old generations are kept by age (--min-age) only"
        )
    for name, generations in sorted(generation_dirs(layout).items()):
        if name in pruned:
            continue  # the env's own entry takes them, each claimed first
        link = layout.env_dir(name)
        live = Path(os.path.realpath(link)) if link.is_symlink() else None
        for generation in generations:
            if live is not None and Path(os.path.realpath(generation)) == live:
                continue
            # It stopped being live when the link last changed (or, orphaned, when built).
            superseded = max(_mtime(generation), _mtime(link) if live is not None else 0.0)
            entry = PruneEntry(
                "generation",
                root_relative(layout, generation),
                f"an old generation of {name!r}",
                None,
                [root_relative(layout, generation)],
                env=name,
                members=[generation],
            )
            if _young(plan, entry, superseded, now):
                continue
            with claim_generation(generation) as claimed:
                if claimed is False:
                    entry.reason = f"in use: a worker runs from it ({entry.reason})"
                    plan.kept.append(entry)
                    continue
            if claimed is None:
                entry.reason += ": no generation lock file (built before them), kept by age only"
            elif not coherence.coherent:
                entry.reason += ": locks are not coherent here, kept by age only"
            else:
                entry.reason += ": no worker holds it"
            entry.bytes = freed_by(generation)
            plan.entries.append(entry)


def used_interpreter_dirs(layout: InstallLayout, manifest: Manifest) -> set[str]:
    """The top-level entries of ``.python/`` some env, generation or build uses.

    Read from every env record's ``python_path``, and from each generation's and
    staging venv's build metadata (``interpreter.path``) and ``pyvenv.cfg`` (``home``),
    both as written and with links resolved (uv's minor-version links).
    """
    paths = [r.get("python_path") for r in manifest.get("envs", {}).values()]
    venvs = [g for gens in generation_dirs(layout).values() for g in gens]
    with contextlib.suppress(OSError):
        venvs += [p for p in layout.build_dir.iterdir() if p.is_dir() and not p.is_symlink()]
    for venv in venvs:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            paths.append(loads_json((venv / ENV_METADATA).read_bytes())["interpreter"]["path"])
        with contextlib.suppress(OSError):
            for line in (venv / "pyvenv.cfg").read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "home":
                    paths.append(value.strip())
    bases = {str(layout.python_dir), os.path.realpath(layout.python_dir)}
    used: set[str] = set()
    for text in paths:
        if not isinstance(text, str) or not text:
            continue
        for candidate in {text, os.path.realpath(text)}:
            for base in bases:
                rel = os.path.relpath(candidate, base)
                if not rel.startswith(".."):
                    used.add(rel.split(os.sep)[0])
    return used


def _plan_interpreters(
    layout: InstallLayout, plan: PrunePlan, manifest: Manifest, now: float
) -> None:
    try:
        entries = sorted(layout.python_dir.iterdir())
    except OSError:
        return
    used = used_interpreter_dirs(layout, manifest)
    for path in entries:
        if path.name.startswith("."):
            continue  # uv's own lock, temp dir and markers
        if path.is_symlink():
            target = os.path.relpath(os.path.realpath(path), os.path.realpath(layout.python_dir))
            in_use = path.name in used or target.split(os.sep)[0] in used
        else:
            in_use = path.name in used
        if in_use or not (path.is_dir() or path.is_symlink()):
            continue
        entry = PruneEntry(
            "interpreter",
            root_relative(layout, path),
            "a managed Python no env, generation or build uses",
            freed_by(path),
            [root_relative(layout, path)],
            members=[path],
        )
        if not _young(plan, entry, _mtime(path), now):
            plan.entries.append(entry)


def _plan_lockfiles(layout: InstallLayout, plan: PrunePlan, pruned: set[str], now: float) -> None:
    for lock in sorted(layout.environments_dir.glob("*.py.lock")):
        name = lock.name.removesuffix(".py.lock")
        if name in pruned or layout.registered_source(name).exists():
            continue
        entry = PruneEntry(
            "lockfile",
            root_relative(layout, lock),
            f"a lockfile without its env file environments/{name}.py",
            freed_by(lock),
            [root_relative(layout, lock)],
            members=[lock],
        )
        if not _young(plan, entry, _mtime(lock), now):
            plan.entries.append(entry)


def _plan_unattributed(
    layout: InstallLayout, plan: PrunePlan, manifest: Manifest, now: float
) -> None:
    """Count what no record's ``files`` lists under cache/ and home/; list it with --deep."""
    listed = Listed(
        {
            f
            for record in manifest.get("envs", {}).values()
            for entry in (record.get("checkpoints") or {}).values()
            for f in (entry.get("files") or [])
            if isinstance(f, str)
        }
    )
    summary = plan.unattributed
    old: dict[str, list[Path]] = {}
    for top_dir in (layout.cache_dir, layout.home_dir):
        for path in _walk_files(top_dir):
            rel = str(path.relative_to(layout.cache_root))
            if listed.covers(rel):
                continue
            size = freed_by(path)
            top = "/".join(PurePosixPath(rel).parts[:2])
            summary.files += 1
            summary.bytes += size
            counts = summary.dirs.setdefault(top, [0, 0])
            counts[0] += 1
            counts[1] += size
            if old_enough(_mtime(path), now, plan.min_age_s):
                old.setdefault(top, []).append(path)
            else:
                summary.young += 1
    if summary.files:
        legacy = sum(
            1
            for record in manifest.get("envs", {}).values()
            for entry in (record.get("checkpoints") or {}).values()
            if entry.get("fetched_at") and not isinstance(entry.get("files"), list)
        )
        if legacy:
            plan.notes.append(
                f"{legacy} fetched checkpoint record(s) list no files (fetched before rootstock "
                "recorded them): their weights are among the unattributed content, and --deep "
                "deletes them too (`rootstock add ID --force` records them)"
            )
    if not plan.deep:
        return
    for top, paths in sorted(old.items()):
        plan.entries.append(
            PruneEntry(
                "unattributed",
                top,
                "content no checkpoint record lists (--deep)",
                sum(freed_by(p) for p in paths),
                [top],
                count=len(paths),
                members=paths,
            )
        )


def _walk_files(top: Path) -> list[Path]:
    """Every non-directory under ``top`` (links are not followed, and count as files)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(top):
        base = Path(dirpath)
        found += [base / n for n in filenames]
        found += [base / n for n in dirnames if (base / n).is_symlink()]
    return sorted(found)
