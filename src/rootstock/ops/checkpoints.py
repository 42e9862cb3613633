"""What add and smoke-test share: which checkpoints apply here, and build references."""

from __future__ import annotations

from typing import Any

from rootstock.errors import CheckpointNotFetched, UsageError
from rootstock.install.envfile import EnvFile, is_custom_id, source_hash
from rootstock.install.envs import load_installed_envs, read_env_metadata, resolve_checkpoint
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import load_manifest, resolve_cluster
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


def is_fetched(manifest: dict[str, Any], env_name: str, checkpoint: str) -> bool:
    """True when the manifest records a fetch of ``checkpoint`` in ``env_name``."""
    recorded = manifest.get("envs", {}).get(env_name, {}).get("checkpoints", {})
    return bool((recorded.get(checkpoint) or {}).get("fetched_at"))


def require_fetched(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    manifest: dict[str, Any] | None = None,
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


def check_selected_checkpoint(
    layout: InstallLayout, checkpoint: str, cluster: str | None = None
) -> None:
    """``smoke-test --checkpoint ID``: the id rule, before anything runs.

    Unknown (exit code 2), ``:custom`` (2: never smoke-tested) and unfetched (1)
    ids are refused, so a typo cannot pass as "nothing to test".
    """
    manifest = load_manifest(layout)
    machine = resolve_cluster(layout, cluster, manifest)
    resolved = resolve_checkpoint(layout, checkpoint, machine)
    if resolved.is_custom:
        raise UsageError(
            f"{checkpoint!r} takes user-supplied weights, which are never smoke-tested",
            hint="pick a registered checkpoint id (`rootstock list`)",
        )
    require_fetched(layout, resolved.env_name, checkpoint, manifest)


def fetched_checkpoints(
    layout: InstallLayout,
    manifest: dict[str, Any],
    cluster: str,
    env_filter: str | None = None,
    checkpoint_filter: str | None = None,
) -> list[tuple[EnvFile, str]]:
    """Every fetched, non-custom checkpoint served on ``cluster``, in a stable order.

    A universal env's id that a variant shadows on this cluster is left out: the
    variant's copy is the one tested and reported here.
    """
    envs, _ = load_installed_envs(layout)
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
