"""What add and smoke-test share: which checkpoints apply here, and build references."""

from __future__ import annotations

from typing import Any

from rootstock.errors import CheckpointNotFetched, EnvBroken, UsageError
from rootstock.install.envfile import EnvFile, is_custom_id, source_hash
from rootstock.install.envs import (
    BrokenEnv,
    InstalledEnvs,
    read_env_metadata,
    require_env_name,
    resolve_checkpoint,
    scan_installed_envs,
)
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import resolve_cluster
from rootstock.install.manifest import Manifest, load_manifest
from rootstock.ops.status import serves_on, variant_ids


def build_snapshot(layout: InstallLayout, env: EnvFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """The build a worker is about to run, and its package versions (one read).

    The first is recorded with the verification: its ``source_hash`` is hashed from
    the live ``env_source.py`` (the one the worker imports), so verifying a hotfix
    records it and clears the stale state. The second goes into the fingerprint.
    """
    meta = read_env_metadata(layout, env.name) or {}
    build = {
        "build_id": meta.get("build_id"),
        "source_hash": source_hash(env.source),
        "built_at": meta.get("built_at"),
        "lock_hash": meta.get("lock_hash"),
    }
    return build, dict(meta.get("versions") or {})


def is_fetched(manifest: Manifest, env_name: str, checkpoint: str) -> bool:
    """True when the manifest records a fetch of ``checkpoint`` in ``env_name``."""
    recorded = manifest.get("envs", {}).get(env_name, {}).get("checkpoints", {})
    return bool((recorded.get(checkpoint) or {}).get("fetched_at"))


def require_fetched(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    manifest: Manifest | None = None,
) -> None:
    """Refuse (exit code 1) a declared checkpoint whose weights were never fetched.

    The rule every command that takes ids follows: an unknown id is a usage error
    (exit code 2, raised by the resolver), an unfetched one a failure that names
    ``rootstock add``.
    """
    if manifest is None:
        manifest = load_manifest(layout)
    if not is_fetched(manifest, env_name, checkpoint):
        raise CheckpointNotFetched(
            f"checkpoint {checkpoint!r} (env {env_name!r}) is not fetched in {layout.root}",
            hint=f"run `rootstock add {checkpoint} --no-verify` first",
        )


def check_selection(
    layout: InstallLayout,
    cluster: str | None = None,
    env: str | None = None,
    checkpoint: str | None = None,
) -> None:
    """``smoke-test --env NAME --checkpoint ID``: the name rule, before anything runs.

    An unknown env or id (exit code 2, with close matches), a ``:custom`` id (2:
    never smoke-tested), an id of another env than ``--env`` (2) and an unfetched
    id (1) are refused, so a typo cannot pass as "nothing to test". An id of a
    broken env passes: the smoke-test stamps it failed with the parse error.
    """
    found = scan_installed_envs(layout)
    if env is not None:
        require_env_name(layout, env, found)
    if checkpoint is None:
        return
    manifest = load_manifest(layout)
    machine = resolve_cluster(layout, cluster, manifest)
    try:
        env_name = resolve_checkpoint(layout, checkpoint, machine).env_name
    except EnvBroken:
        owner = next((b.name for b in found.broken if checkpoint in b.recorded_ids), None)
        if owner is None:  # it broke between the two reads: report it as resolved
            raise
        env_name = owner
    if is_custom_id(checkpoint):
        raise UsageError(
            f"{checkpoint!r} takes user-supplied weights, which are never smoke-tested",
            hint="pick a registered checkpoint id (`rootstock list`)",
        )
    if env is not None and env != env_name:
        raise UsageError(
            f"checkpoint {checkpoint!r} is served by env {env_name!r}, not {env!r}",
            hint=f"drop --env, or pass --env {env_name}",
        )
    require_fetched(layout, env_name, checkpoint, manifest)


def fetched_checkpoints(
    layout: InstallLayout,
    manifest: Manifest,
    cluster: str,
    env_filter: str | None = None,
    checkpoint_filter: str | None = None,
    found: InstalledEnvs | None = None,
) -> list[tuple[EnvFile, str]]:
    """Every fetched, non-custom checkpoint served on ``cluster``, in a stable order.

    A universal env's id that a variant shadows on this cluster is left out: the
    variant's copy is the one tested and reported here. Broken envs are not here
    (:func:`broken_checkpoints`).
    """
    envs = (found if found is not None else scan_installed_envs(layout)).envs
    variants = variant_ids(envs)
    selected = []
    for env in envs:
        if env_filter and env.name != env_filter:
            continue
        recorded = manifest.get("envs", {}).get(env.name, {}).get("checkpoints", {})
        for checkpoint in env.checkpoints:
            if is_custom_id(checkpoint) or (checkpoint_filter and checkpoint != checkpoint_filter):
                continue
            if not (recorded.get(checkpoint) or {}).get("fetched_at"):
                continue
            if serves_on(env, checkpoint, cluster, variants):
                selected.append((env, checkpoint))
    return selected


def broken_checkpoints(
    found: InstalledEnvs, env_filter: str | None = None, checkpoint_filter: str | None = None
) -> list[tuple[BrokenEnv, str]]:
    """Every fetched, non-custom id of a broken env, as the manifest recorded them.

    Which cluster a broken env serves is unknown while it does not parse, so each
    one counts wherever it is tested: every spawn of it would fail there.
    """
    return [
        (broken, checkpoint)
        for broken in found.broken
        if not env_filter or broken.name == env_filter
        for checkpoint in broken.fetched_ids
        if not is_custom_id(checkpoint)
        and (not checkpoint_filter or checkpoint == checkpoint_filter)
    ]


def broken_build(layout: InstallLayout, broken: BrokenEnv) -> dict[str, Any]:
    """The build a failure of ``broken`` is recorded against: its live, unparsable source.

    Recording the live hash is what makes ``status`` show the failure itself rather
    than ``stale`` (the source changed since the last verification).
    """
    meta = read_env_metadata(layout, broken.name) or {}
    build = {
        "build_id": meta.get("build_id"),
        "built_at": meta.get("built_at"),
        "lock_hash": meta.get("lock_hash"),
    }
    live = broken.live_source_hash()
    if live:
        build["source_hash"] = live
    return build
