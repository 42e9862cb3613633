"""``rootstock info CHECKPOINT``: everything the install knows about one checkpoint.

What it is (the env file's ``CHECKPOINT_INFO``), which env and build serve it (the
build id, the versions its lockfile resolved, its image), the weight files its
record lists (with the size and sha256 ``add`` recorded, or the size on disk), and
its verifications per cluster and device kind, with the physics checks' ratios.
It only reads: the env file, the build's metadata and lockfile, and the manifest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypedDict

from rootstock.install.envfile import CheckpointInfo, EnvFile, is_custom_id, source_hash
from rootstock.install.envs import read_env_metadata, resolve_checkpoint
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    CheckpointRecord,
    Checks,
    ImageRecord,
    checkpoint_state,
    load_manifest,
)
from rootstock.runtime import read_env_lock, resolved_versions


class BuildInfo(TypedDict):
    """The build of the env that serves the checkpoint (``info --json``'s ``build``)."""

    build_id: str | None
    built_at: str | None
    python: str | None
    lockfile: str | None
    #: Each direct dependency of the env file, and torch, with the version the
    #: lockfile resolved (the installed one where the lock holds one per Python).
    packages: dict[str, str | None]
    image: ImageRecord | None


class WeightInfo(TypedDict):
    """One file the checkpoint's record lists (relative to the cache root)."""

    path: str
    size: int | None
    sha256: str | None
    present: bool


class VerificationInfo(TypedDict):
    """The latest verification on one cluster and device kind."""

    cluster: str
    device_kind: str | None
    state: str
    recorded_state: str | None
    at: str | None
    device: str | None
    message: str | None
    build_id: str | None
    checks: Checks | None


class CheckpointReport(TypedDict):
    """What :func:`checkpoint_report` returns and ``rootstock info --json`` prints."""

    checkpoint: str
    env: str
    upstream: str | None
    custom: bool
    info: CheckpointInfo
    build: BuildInfo | None
    fetched_at: str | None
    files: list[WeightInfo] | None
    verifications: list[VerificationInfo]


def checkpoint_report(
    layout: InstallLayout, checkpoint: str, cluster: str | None = None
) -> CheckpointReport:
    """Everything about ``checkpoint`` as the env serving it on ``cluster`` declares it.

    An id no installed env declares raises
    :class:`~rootstock.errors.CheckpointNotDeclared`, with the fix in its hint.
    """
    resolved = resolve_checkpoint(layout, checkpoint, cluster)
    env = resolved.env
    manifest = load_manifest(layout)
    entry: CheckpointRecord = (
        manifest.get("envs", {}).get(env.name, {}).get("checkpoints", {}).get(checkpoint) or {}
    )
    current_hash = source_hash(env.source)
    verifications: list[VerificationInfo] = []
    for where, by_kind in sorted((entry.get("verifications") or {}).items()):
        for kind, record in sorted(by_kind.items()):
            state = checkpoint_state(
                manifest, env.name, checkpoint, where, kind, current_source_hash=current_hash
            )
            verifications.append(
                {
                    "cluster": where,
                    "device_kind": kind,
                    "state": state.state,
                    "recorded_state": state.recorded_state,
                    "at": record.get("at"),
                    "device": record.get("device"),
                    "message": state.message,
                    "build_id": (record.get("build") or {}).get("build_id"),
                    "checks": state.checks,
                }
            )
    return {
        "checkpoint": checkpoint,
        "env": env.name,
        "upstream": resolved.upstream,
        "custom": is_custom_id(checkpoint),
        "info": env.checkpoint_info.get(checkpoint, {}),
        "build": build_info(layout, env),
        "fetched_at": entry.get("fetched_at"),
        "files": weight_files(layout.cache_root, entry),
        "verifications": verifications,
    }


def build_info(layout: InstallLayout, env: EnvFile) -> BuildInfo | None:
    """The env's current build from its ``rootstock-env.json`` and lockfile; None when
    the build left no metadata."""
    meta = read_env_metadata(layout, env.name)
    if meta is None:
        return None
    probed = meta.get("versions") or {}
    lock = read_env_lock(layout, env.name)
    return {
        "build_id": meta.get("build_id"),
        "built_at": meta.get("built_at"),
        "python": probed.get("python"),
        "lockfile": str(lock.path) if lock is not None and lock.versions else None,
        "packages": resolved_versions(env.dependencies, lock, probed),
        "image": meta.get("image"),
    }


def weight_files(cache_root: Path, entry: CheckpointRecord) -> list[WeightInfo] | None:
    """The record's files with what is known of each: the ``weights`` record's size and
    sha256 where ``add`` hashed it, else the size on disk; None when unattributed."""
    recorded: dict[str, Any] = dict(entry.get("weights") or {})
    files = entry.get("files")
    if files is None and not recorded:
        return None
    rows: list[WeightInfo] = []
    for relative in dict.fromkeys([*(files or []), *recorded]):
        weight = recorded.get(relative) or {}
        try:
            st = os.stat(cache_root / relative)
        except OSError:
            st = None
        size = weight.get("size")
        if size is None and st is not None:
            size = st.st_size
        rows.append(
            {
                "path": relative,
                "size": size,
                "sha256": weight.get("sha256"),
                "present": st is not None,
            }
        )
    return rows
