"""``rootstock list``: installed envs and the checkpoint ids they declare."""

from __future__ import annotations

from typing import Any, TypedDict

from rootstock.install.envfile import is_custom_id
from rootstock.install.envs import scan_installed_envs
from rootstock.install.layout import InstallLayout


class ListedEnv(TypedDict):
    """One env of ``rootstock list --json``."""

    name: str
    checkpoints: list[str]
    custom: list[str]
    clusters: list[str] | None
    verify_kwargs: dict[str, dict[str, Any]]
    #: Each id's ``CHECKPOINT_INFO`` licence (None where the env file gives none).
    licences: dict[str, str | None]
    #: The gated ids, each with the URL where access is requested.
    gated: dict[str, str]
    error: str | None


class EnvListing(TypedDict):
    """What :func:`list_envs` returns and ``rootstock list --json`` prints."""

    root: str
    envs: list[ListedEnv]
    warnings: list[str]


def list_envs(layout: InstallLayout) -> EnvListing:
    """Every built env with its ids, custom entries and cluster variants.

    A broken env (its ``env_source.py`` does not parse) is listed too, with
    ``error`` set to ``file:line: message`` and the ids the manifest recorded for
    it; ``clusters`` is then None and ``licences`` and ``gated`` are empty, because
    the file cannot be read.
    """
    found = scan_installed_envs(layout)
    rows: list[ListedEnv] = [
        {
            "name": env.name,
            "checkpoints": [c for c in env.checkpoints if not is_custom_id(c)],
            "custom": [c for c in env.checkpoints if is_custom_id(c)],
            "clusters": env.clusters,
            "verify_kwargs": env.verify_kwargs,
            "licences": {c: env.checkpoint_info.get(c, {}).get("licence") for c in env.checkpoints},
            "gated": {c: url for c in env.checkpoints if (url := env.gated_url(c))},
            "error": None,
        }
        for env in found.envs
    ]
    rows.extend(
        {
            "name": broken.name,
            "checkpoints": [c for c in broken.recorded_ids if not is_custom_id(c)],
            "custom": [c for c in broken.recorded_ids if is_custom_id(c)],
            "clusters": None,
            "verify_kwargs": {},
            "licences": {},
            "gated": {},
            "error": broken.message,
        }
        for broken in found.broken
    )
    rows.sort(key=lambda row: row["name"])
    return {"root": str(layout.root), "envs": rows, "warnings": found.warnings}
