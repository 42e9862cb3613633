"""``rootstock list``: installed envs and the checkpoint ids they declare."""

from __future__ import annotations

from rootstock.install.envfile import is_custom_id
from rootstock.install.envs import load_installed_envs
from rootstock.install.layout import InstallLayout


def list_envs(layout: InstallLayout) -> dict:
    """Every built env with its ids, custom entries and cluster variants."""
    envs, warnings = load_installed_envs(layout)
    rows = []
    for env in envs:
        rows.append(
            {
                "name": env.name,
                "checkpoints": [c for c in env.checkpoints if not is_custom_id(c)],
                "custom": [c for c in env.checkpoints if is_custom_id(c)],
                "clusters": env.clusters,
                "verify_kwargs": env.verify_kwargs,
            }
        )
    return {"root": str(layout.root), "envs": rows, "warnings": warnings}
