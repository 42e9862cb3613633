"""Which calculators may share one worker: the worker key.

Two calculators share a warm worker (in one process, or through a user's pool
across processes) only when everything the worker loaded from is the same: the
install root and cache root, the env *generation* (``envs/<name>`` resolves to
``envs/.<name>.<build-id>``), the bytes of its ``env_source.py`` (a hotfix keeps
the build id but changes what ``setup()`` does), the checkpoint, the device,
``setup()``'s keywords and user weights, and for a GPU device the accelerators
this process may see (``CUDA_VISIBLE_DEVICES`` and its ROCm and oneAPI
counterparts, which Parsl and the Dask plugin set per engine worker), so workers
pinned to different GPUs never share. ``timeout`` is per call and is not part of
the key.

The key is computed again at every attach, so a rebuild or a hotfix gives a new
key and a fresh worker; a worker already running for the old key finishes its
callers and goes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rootstock.errors import EnvNotFound

if TYPE_CHECKING:
    from rootstock.runtime.spec import WorkerSpec


@dataclass(frozen=True)
class WorkerKey:
    """The identity of a worker that calculators may share."""

    root: str
    cache_root: str
    env_name: str
    generation: str  # realpath of envs/<name>: the build the worker imports from
    source_sha256: str  # of that generation's env_source.py
    checkpoint: str
    device: str
    setup_kwargs: str  # canonical JSON
    weights: str | None
    visible_devices: str = ""  # the accelerator-visibility variables, for a GPU device

    @property
    def digest(self) -> str:
        """A short stable hash of the whole key (names pool sockets and ids)."""
        text = json.dumps(
            [
                self.root,
                self.cache_root,
                self.env_name,
                self.generation,
                self.source_sha256,
                self.checkpoint,
                self.device,
                self.setup_kwargs,
                self.weights,
                self.visible_devices,
            ]
        )
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def visible_devices(device: str) -> str:
    """The accelerator-visibility variables set in this process, for a non-CPU device:
    CUDA's, ROCm's and oneAPI's (each read by name, so the variable scan sees them)."""
    if device == "cpu":
        return ""
    found = (
        ("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES")),
        ("ROCR_VISIBLE_DEVICES", os.environ.get("ROCR_VISIBLE_DEVICES")),
        ("ZE_AFFINITY_MASK", os.environ.get("ZE_AFFINITY_MASK")),
    )
    return ";".join(f"{name}={value}" for name, value in found if value is not None)


def worker_key(spec: WorkerSpec) -> WorkerKey:
    """The key of the worker ``spec`` would start now (reads the env's source file)."""
    layout = spec.layout
    generation = str(layout.generation(spec.env_name))
    source = os.path.join(generation, os.path.basename(spec.env_source))
    try:
        with open(source, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        raise EnvNotFound(
            f"env {spec.env_name!r} has no readable env_source.py at {source} "
            f"({exc.strerror or exc})"
        ) from None
    return WorkerKey(
        root=str(layout.root),
        cache_root=str(layout.cache_root),
        env_name=spec.env_name,
        generation=generation,
        source_sha256=digest,
        checkpoint=spec.checkpoint,
        device=spec.device,
        setup_kwargs=json.dumps(spec.setup_kwargs, sort_keys=True, allow_nan=True),
        weights=str(spec.weights) if spec.weights is not None else None,
        visible_devices=visible_devices(spec.device),
    )
