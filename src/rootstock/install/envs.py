"""Installed envs, and which env serves a checkpoint id.

Ids resolve from the *built* ``envs/<name>/env_source.py`` (which a hotfix may
edit), never from ``environments/*.py`` (which only builds read). Nothing is
cached across calls: every resolution reads the files afresh.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path

from rootstock.errors import (
    AmbiguousCheckpoint,
    CheckpointNotDeclared,
    EnvFileError,
    EnvNotFound,
)
from rootstock.install.envfile import EnvFile, is_custom_id, parse_env_file
from rootstock.install.layout import InstallLayout

ENV_METADATA = "rootstock-env.json"


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """A checkpoint id bound to the env that serves it on this cluster."""

    checkpoint: str
    env: EnvFile
    upstream: str | None

    @property
    def env_name(self) -> str:
        return self.env.name

    @property
    def is_custom(self) -> bool:
        return is_custom_id(self.checkpoint)


def installed_env_names(layout: InstallLayout) -> list[str]:
    """Names of envs that finished building (they have an env_source.py)."""
    if not layout.envs_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in layout.envs_dir.iterdir()
        if not p.name.startswith(".") and (p / "env_source.py").is_file()
    )


def load_installed_env(layout: InstallLayout, name: str) -> EnvFile:
    """Parse one built env's ``env_source.py``; lint problems do not stop reading."""
    path = layout.env_source(name)
    if not path.is_file():
        raise EnvNotFound(
            f"no env named {name!r} is installed in {layout.root}",
            hint=f"install it with `rootstock install environments/{name}.py`",
        )
    env, _ = parse_env_file(path, name)
    return env


def load_installed_envs(layout: InstallLayout) -> tuple[list[EnvFile], list[str]]:
    """Every built env, plus a warning line for each one that cannot be read."""
    envs, warnings = [], []
    for name in installed_env_names(layout):
        try:
            envs.append(load_installed_env(layout, name))
        except EnvFileError as exc:
            warnings.append(f"env {name!r}: {exc.message}")
    return envs, warnings


def envs_on_cluster(envs: list[EnvFile], cluster: str | None) -> list[EnvFile]:
    """The envs that apply on ``cluster``: universal ones plus its variants."""
    return [e for e in envs if not e.is_variant or (cluster and cluster.lower() in e.clusters)]


def resolve_checkpoint(
    layout: InstallLayout, checkpoint: str, cluster: str | None = None
) -> ResolvedCheckpoint:
    """Find the env that serves ``checkpoint`` on ``cluster``.

    A ``CLUSTERS`` variant wins on the clusters it lists. Without a cluster, an id
    that only variants declare is ambiguous, and the error says which clusters.
    """
    envs, _ = load_installed_envs(layout)
    declaring = [e for e in envs if checkpoint in e.checkpoints]
    cluster_key = cluster.lower() if cluster else None
    variants = [e for e in declaring if e.is_variant]
    universal = [e for e in declaring if not e.is_variant]
    chosen: EnvFile | None = None
    if cluster_key:
        matching = [e for e in variants if cluster_key in (e.clusters or [])]
        chosen = (matching or universal or [None])[0]
    elif universal:
        chosen = universal[0]
    elif variants:
        clusters = sorted({c for e in variants for c in e.clusters or []})
        raise AmbiguousCheckpoint(
            f"checkpoint {checkpoint!r} is only declared by cluster variants "
            f"(for {', '.join(clusters)})",
            hint='say which machine this is: cluster="NAME" or --cluster NAME',
        )
    if chosen is None:
        raise _not_declared(layout, checkpoint, envs_on_cluster(envs, cluster_key), cluster)
    return ResolvedCheckpoint(checkpoint, chosen, chosen.checkpoints[checkpoint])


def _not_declared(
    layout: InstallLayout, checkpoint: str, envs: list[EnvFile], cluster: str | None
) -> CheckpointNotDeclared:
    known = sorted({cid for e in envs for cid in e.checkpoints})
    close = difflib.get_close_matches(checkpoint, known, n=5, cutoff=0.5)
    where = f"{layout.root}" + (f" for cluster {cluster!r}" if cluster else "")
    message = f"unknown checkpoint {checkpoint!r} in {where}"
    if close:
        message += f"; close matches: {', '.join(close)}"
    elif not known:
        message += "; no envs are installed"
    return CheckpointNotDeclared(
        message, hint="`rootstock list` shows every installed checkpoint id"
    )


def env_metadata_path(layout: InstallLayout, name: str) -> Path:
    """Build metadata written next to the env (interpreter, versions, hashes)."""
    return layout.env_dir(name) / ENV_METADATA


def read_env_metadata(layout: InstallLayout, name: str) -> dict | None:
    """The ``rootstock-env.json`` of a built env, or None if absent or unreadable."""
    try:
        data = json.loads(env_metadata_path(layout, name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
