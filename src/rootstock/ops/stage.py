"""``rootstock stage``: stage builds on this node ahead of time, list and clean stages."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rootstock.errors import CheckpointNotDeclared, EnvNotFound, UsageError
from rootstock.install.envs import installed_env_names, resolve_checkpoint
from rootstock.install.layout import InstallLayout
from rootstock.runtime import (
    StagedEntry,
    StageRefused,
    build_image,
    clean_stages,
    list_stages,
    stage_image,
)


@dataclass
class StageOutcome:
    """What staging one env did: ``staged``, ``no-image`` or ``refused``."""

    env: str
    status: str
    mode: str | None = None
    path: Path | None = None
    seconds: float = 0.0
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``stage --json``."""
        return {
            "env": self.env,
            "status": self.status,
            "mode": self.mode,
            "path": str(self.path) if self.path else None,
            "seconds": round(self.seconds, 3),
            "message": self.message,
        }


def envs_named(
    layout: InstallLayout, targets: list[str], everything: bool, cluster: str | None
) -> list[str]:
    """The env names that ``targets`` (env names or checkpoint ids) or ``--all`` mean."""
    installed = installed_env_names(layout)
    if everything:
        return sorted(installed)
    if not targets:
        raise UsageError("name what to stage", hint="pass checkpoint ids or env names, or --all")
    names: list[str] = []
    for target in targets:
        if target in installed:
            name = target
        else:
            try:
                name = resolve_checkpoint(layout, target, cluster).env.name
            except (EnvNotFound, CheckpointNotDeclared):
                raise UsageError(
                    f"{target!r} is neither an installed env nor a checkpoint id of {layout.root}",
                    hint="`rootstock list` shows both",
                ) from None
        if name not in names:
            names.append(name)
    return names


def stage_envs(layout: InstallLayout, names: list[str], mode: str) -> list[StageOutcome]:
    """Stage each env's current build on this node by ``mode``; one outcome each.

    A mount stays for the idle timeout (``$ROOTSTOCK_STAGE_IDLE_S``) unless a worker
    uses it; a copy stays until ``stage --clean``.
    """
    outcomes = []
    for name in names:
        image = build_image(layout, name)
        if image is None:
            outcomes.append(
                StageOutcome(
                    name,
                    "no-image",
                    message=f"its build has no image (rebuild with `rootstock install {name} "
                    "--force --image`)",
                )
            )
            continue
        started = time.monotonic()
        try:
            stage = stage_image(image, mode)
        except StageRefused as exc:
            outcomes.append(StageOutcome(name, "refused", message=str(exc)))
            continue
        stage.release()
        outcomes.append(
            StageOutcome(name, "staged", stage.mode, stage.prefix, time.monotonic() - started)
        )
    return outcomes


def stages_here() -> list[StagedEntry]:
    """``stage --list``: this user's stages on this node."""
    return list_stages()


def clean_here() -> tuple[list[str], list[str]]:
    """``stage --clean``: remove this user's unused stages on this node; (removed, kept)."""
    return clean_stages()
