"""``rootstock status``: envs, build state, and each checkpoint's state per cluster.

Reads only small files (env sources, build metadata, the manifest). Directory
sizes are opt-in: walking gigabytes on Lustre at every call is too slow.

A built env whose ``env_source.py`` does not parse, or is no longer a regular file
(a directory, a FIFO), shows as ``broken`` with ``file:line: message`` in ``error``;
its rows are the ids the manifest recorded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from rootstock.install.build import building_envs
from rootstock.install.envfile import EnvFile, is_custom_id, source_hash
from rootstock.install.envs import BrokenEnv, read_env_metadata, scan_installed_envs
from rootstock.install.layout import InstallLayout
from rootstock.install.locking import probe_lock
from rootstock.install.machine import served_clusters
from rootstock.install.manifest import Manifest, checkpoint_state, load_manifest

#: The state ``status`` shows, in place of ``not fetched``, for a checkpoint whose
#: ``CHECKPOINT_INFO`` names a ``gated`` URL (the manifest never stores it).
GATED = "gated"


class CheckpointRow(TypedDict):
    """One checkpoint of an env: its cell (``CheckpointState.to_dict``) per cluster."""

    id: str
    states: dict[str, dict[str, Any]]


class EnvRow(TypedDict):
    """One env of the status document (docs/cli.md, ``status --json``)."""

    name: str
    state: str
    error: str | None
    python: str | None
    torch: str | None
    built_at: str | None
    interpreter: str | None
    clusters: list[str] | None
    hotfixed: bool
    checkpoints: list[CheckpointRow]
    size_bytes: NotRequired[int | None]


class CacheSizes(TypedDict):
    """Bytes under the install's cache and home directories (``status --sizes``)."""

    cache: int
    home: int


class StatusDoc(TypedDict):
    """What :func:`status` returns and ``status --json`` prints."""

    root: str
    cache_root: str
    clusters: list[str]
    envs: list[EnvRow]
    warnings: list[str]
    cache_size_bytes: NotRequired[CacheSizes]


def directory_size(path: Path) -> int:
    """Bytes used by the files under ``path`` (symlinks not followed, hard links once)."""
    total, seen = 0, set()
    for dirpath, _dirs, files in os.walk(os.path.realpath(path)):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def build_state(layout: InstallLayout, name: str, built: bool) -> str:
    """``built``, ``building`` (an install holds its lock) or ``not built``.

    The lock files are the maintainers' alone (a read lock would stall their
    writes); for anyone else a live build's owner record in ``.build/`` tells.
    """
    held = probe_lock(layout.locks_dir / f"env-{name}.lock")
    if held is None:
        held = name in building_envs(layout)
    if held:
        return "building"
    return "built" if built else "not built"


def status(layout: InstallLayout, cluster: str | None = None, sizes: bool = False) -> StatusDoc:
    """The status document that ``rootstock status`` renders (and prints with --json)."""
    manifest = load_manifest(layout)
    clusters = [cluster.lower()] if cluster else served_clusters(layout, manifest)
    found = scan_installed_envs(layout)
    envs = found.envs
    built = {e.name: e for e in envs}
    broken = {b.name: b for b in found.broken}
    variants = variant_ids(envs)
    registered = (
        {p.stem for p in layout.environments_dir.glob("*.py")}
        if layout.environments_dir.is_dir()
        else set()
    )
    rows: list[EnvRow] = []
    for name in sorted(set(built) | set(broken) | registered | set(manifest.get("envs", {}))):
        env = built.get(name)
        meta = read_env_metadata(layout, name) or {}
        versions = meta.get("versions") or {}
        state = build_state(layout, name, env is not None or name in broken)
        if name in broken and state == "built":
            state = "broken"
        row: EnvRow = {
            "name": name,
            "state": state,
            "error": broken[name].message if name in broken else None,
            "python": versions.get("python"),
            "torch": versions.get("torch"),
            "built_at": meta.get("built_at"),
            "interpreter": (meta.get("interpreter") or {}).get("path"),
            "clusters": env.clusters if env else None,
            "hotfixed": bool(
                env and meta.get("source_hash") and source_hash(env.source) != meta["source_hash"]
            ),
            "checkpoints": _checkpoint_rows(manifest, env, clusters, variants)
            if env
            else _broken_rows(layout, manifest, broken[name], clusters)
            if name in broken
            else [],
        }
        if sizes:
            row["size_bytes"] = directory_size(layout.env_dir(name)) if env else None
        rows.append(row)
    doc: StatusDoc = {
        "root": str(layout.root),
        "cache_root": str(layout.cache_root),
        "clusters": clusters,
        "envs": rows,
        "warnings": found.warnings,
    }
    if sizes:
        doc["cache_size_bytes"] = {
            "cache": directory_size(layout.cache_dir) if layout.cache_dir.exists() else 0,
            "home": directory_size(layout.home_dir) if layout.home_dir.exists() else 0,
        }
    return doc


def _checkpoint_rows(
    manifest: Manifest, env: EnvFile, clusters: list[str], variants: set[tuple[str, str]]
) -> list[CheckpointRow]:
    current_hash = source_hash(env.source)
    rows: list[CheckpointRow] = []
    for checkpoint in env.checkpoints:
        if is_custom_id(checkpoint):
            continue
        states = {}
        for cluster in clusters:
            if not serves_on(env, checkpoint, cluster, variants):
                continue
            cell = checkpoint_state(
                manifest, env.name, checkpoint, cluster, current_source_hash=current_hash
            ).to_dict()
            states[cluster] = _gated_if_unfetched(cell, env.gated_url(checkpoint))
        if states or not clusters:
            rows.append({"id": checkpoint, "states": states})
    return rows


def _gated_if_unfetched(cell: dict[str, Any], gated_url: str | None) -> dict[str, Any]:
    """A gated checkpoint not fetched yet shows as ``gated``, with where to ask for access:
    what stands between it and ``fetched`` is a licence to accept, not a download."""
    if gated_url and cell["state"] == "not fetched":
        cell["state"] = GATED
        cell["message"] = f"request access at {gated_url}, then set HF_TOKEN"
    return cell


def _broken_rows(
    layout: InstallLayout, manifest: Manifest, broken: BrokenEnv, clusters: list[str]
) -> list[CheckpointRow]:
    """A broken env's recorded ids, on every cluster: which ones it serves is unknown
    until the file parses again, and hiding them would hide what is now failing."""
    current_hash = broken.live_source_hash()
    return [
        {
            "id": checkpoint,
            "states": {
                cluster: checkpoint_state(
                    manifest, broken.name, checkpoint, cluster, current_source_hash=current_hash
                ).to_dict()
                for cluster in clusters
            },
        }
        for checkpoint in broken.recorded_ids
        if not is_custom_id(checkpoint)
    ]


def variant_ids(envs: list[EnvFile]) -> set[tuple[str, str]]:
    """Every (cluster, checkpoint id) that a ``CLUSTERS`` variant declares."""
    return {
        (c, cid) for e in envs if e.is_variant for c in e.clusters or [] for cid in e.checkpoints
    }


def serves_on(env: EnvFile, checkpoint: str, cluster: str, variants: set[tuple[str, str]]) -> bool:
    """True when ``env`` is the one that serves ``checkpoint`` on ``cluster``.

    ``variants`` is :func:`variant_ids` of all installed envs. A universal env's id
    is shadowed on clusters where a variant declares it, so the shadowed copy never
    shows as a row there.
    """
    if env.is_variant:
        return cluster in (env.clusters or [])
    return (cluster, checkpoint) not in variants
