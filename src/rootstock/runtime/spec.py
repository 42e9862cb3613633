"""What to run: a checkpoint bound to its env, plus the arguments for ``setup()``.

This is the one runtime module that reads the install root, and only through the
read-only resolvers in ``install.machine`` and ``install.envs``. Both the calculator
and ``rootstock serve`` validate their arguments here, so they fail the same way
and before any process is started.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import EnvFileError, UsageError
from rootstock.install.envs import resolve_checkpoint
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import resolve_machine
from rootstock.runtime.stage import stage_mode

# setup() receives these from rootstock itself; letting setup_kwargs replace them
# would make the manifest's record of what ran untrue.
RESERVED_SETUP_KWARGS = ("checkpoint", "device", "path")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to spawn a worker for one checkpoint."""

    layout: InstallLayout
    checkpoint: str
    env_name: str
    device: str = "cuda"
    setup_kwargs: dict[str, Any] = field(default_factory=dict)
    weights: Path | None = None
    cluster: str | None = None
    #: How the worker is staged on its node (:mod:`rootstock.runtime.stage`); None
    #: reads ``$ROOTSTOCK_STAGE`` and config.toml when it is spawned.
    stage: str | None = None
    #: Refuse, before ``setup()``, a device this node does not show (verification:
    #: a pass on it would be recorded). Never pooled or shared, so not in the JSON.
    check_device: bool = False

    @property
    def python(self) -> Path:
        """The env's own interpreter, which runs the worker."""
        return self.layout.env_python(self.env_name)

    @property
    def env_source(self) -> Path:
        """The env's built ``env_source.py``, whose ``setup()`` the worker calls."""
        return self.layout.env_source(self.env_name)

    def to_json(self) -> str:
        """This spec as JSON text (a pool daemon is started with it)."""
        return json.dumps(
            {
                "root": str(self.layout.root),
                "cache_root": str(self.layout.cache_root),
                "checkpoint": self.checkpoint,
                "env_name": self.env_name,
                "device": self.device,
                "setup_kwargs": self.setup_kwargs,
                "weights": str(self.weights) if self.weights is not None else None,
                "cluster": self.cluster,
                "stage": self.stage,
            },
            allow_nan=True,
        )

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        """The spec :meth:`to_json` wrote."""
        data = json.loads(text)
        return cls(
            layout=InstallLayout(root=Path(data["root"]), cache_root=Path(data["cache_root"])),
            checkpoint=data["checkpoint"],
            env_name=data["env_name"],
            device=data["device"],
            setup_kwargs=dict(data.get("setup_kwargs") or {}),
            weights=Path(data["weights"]) if data.get("weights") else None,
            cluster=data.get("cluster"),
            stage=data.get("stage"),
        )


def check_setup_kwargs(setup_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Validate keyword arguments for ``setup()``: strings, not reserved, JSON-able."""
    if setup_kwargs is None:
        return {}
    if not isinstance(setup_kwargs, dict) or not all(isinstance(k, str) for k in setup_kwargs):
        raise UsageError("setup_kwargs must be a dict with string keys")
    reserved = sorted(set(setup_kwargs) & set(RESERVED_SETUP_KWARGS))
    if reserved:
        raise UsageError(
            f"setup_kwargs may not set {', '.join(reserved)}",
            hint="pass the checkpoint id as checkpoint=, the device as device=, "
            "and user weights as weights=",
        )
    try:
        json.dumps(setup_kwargs, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"setup_kwargs must be JSON-serialisable ({exc})",
            hint="the worker receives them as JSON; pass numbers, strings, lists or dicts",
        ) from None
    return dict(setup_kwargs)


@dataclass(frozen=True)
class WorkerOptions:
    """How a user asks for a worker, before the install is read.

    The keywords of :class:`~rootstock.runtime.calculator.RootstockCalculator` and of
    ``rootstock serve``/``benchmark`` other than the checkpoint; nothing is checked
    until :func:`resolve_worker_spec`. ``root``, ``cluster`` and ``cache_root`` come
    first, in the order :func:`~rootstock.install.machine.resolve_machine` takes them.
    ``setup_kwargs`` None means none were given (``benchmark`` then takes the env's
    ``VERIFY_KWARGS`` entry); the spec always holds a dict. ``stage`` None reads
    ``$ROOTSTOCK_STAGE`` and config.toml (:func:`~rootstock.runtime.stage.stage_mode`).
    """

    root: str | os.PathLike[str] | None = None
    cluster: str | None = None
    cache_root: str | os.PathLike[str] | None = None
    device: str = "cuda"
    setup_kwargs: dict[str, Any] | None = None
    weights: str | os.PathLike[str] | None = None
    stage: str | None = None


def resolve_worker_spec(checkpoint: str, options: WorkerOptions) -> WorkerSpec:
    """Resolve ``checkpoint`` to an installed env and validate ``options``.

    ``options.cluster`` names this machine. Unless ``options.root`` is given, a
    registered name supplies the root, before ``$ROOTSTOCK_ROOT`` and config.toml; a
    name that neither the registry nor the install's manifest knows is a
    ``UsageError``. Without it, the ``cluster`` recorded in config.toml picks variants.
    """
    device, weights = options.device, options.weights
    if not isinstance(checkpoint, str) or not checkpoint:
        raise UsageError("checkpoint must be a non-empty checkpoint id such as 'emt'")
    if not isinstance(device, str) or not device:
        raise UsageError("device must be a string such as 'cuda', 'cpu' or 'xpu'")
    kwargs = check_setup_kwargs(options.setup_kwargs)
    stage = stage_mode(options.stage)
    machine = resolve_machine(
        options.root, options.cluster, options.cache_root, cluster_from_config=True
    )
    layout = machine.layout
    resolved = resolve_checkpoint(layout, checkpoint, machine.cluster)
    env = resolved.env
    weights_path = None
    if resolved.is_custom:
        if weights is None:
            raise UsageError(
                f"{checkpoint!r} runs your own weights, and none were given",
                hint="pass weights=PATH (or --weights PATH) to your weights file",
            )
        if not env.has_setup_from_path:
            raise EnvFileError(
                f"env {env.name!r} declares {checkpoint!r} but its built env_source.py "
                "has no setup_from_path(), so it cannot load user weights",
                hint=f'maintainer: define setup_from_path(path, device="cuda", **kw) in '
                f"{layout.env_source(env.name)} and environments/{env.name}.py, "
                "or drop the :custom entry",
            )
        weights_path = Path(weights).expanduser().absolute()
        if not weights_path.exists():
            raise UsageError(
                f"weights {weights_path} does not exist (no such file or directory)",
                hint="pass the path of your weights file, or of the directory some families "
                "save (matgl's Potential.save)",
            )
    elif weights is not None:
        customs = [c for c in env.checkpoints if c.endswith(":custom")]
        raise UsageError(
            f"weights= is only for <family>:custom checkpoints, and {checkpoint!r} is not one",
            hint=f"use {customs[0]!r} with weights="
            if customs
            else f"env {env.name!r} takes no user weights",
        )
    return WorkerSpec(
        layout=layout,
        checkpoint=checkpoint,
        env_name=env.name,
        device=device,
        setup_kwargs=kwargs,
        weights=weights_path,
        cluster=machine.cluster,
        stage=stage,
    )
