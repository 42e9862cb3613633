"""``rootstock add``: fetch a checkpoint's weights, then verify them.

The two phases can run on different nodes. *Download* runs on the CPU with the
network allowed: it calls the env's ``download()`` hook, or ``setup()`` on the
CPU, so the weights land in the cache root. *Verify* runs on ``--device`` with
``HF_HUB_OFFLINE=1``. A re-run skips the download when the manifest says the
checkpoint is fetched, and verifies again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rootstock.errors import RootstockError, UsageError
from rootstock.install import Reporter
from rootstock.install.envfile import is_custom_id
from rootstock.install.envs import resolve_checkpoint
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    Verification,
    load_manifest,
    record_fetch,
    resolve_cluster,
)
from rootstock.install.perms import maintainer_umask
from rootstock.ops.verify import DEFAULT_VERIFY_TIMEOUT, VerifyOutcome, verify_and_record

DEFAULT_DOWNLOAD_TIMEOUT = 3600.0


@dataclass
class AddResult:
    """What ``add`` did for one checkpoint."""

    checkpoint: str
    env: str
    cluster: str
    downloaded: bool
    download_seconds: float | None
    verification: VerifyOutcome | None
    record: Verification | None

    @property
    def ok(self) -> bool:
        """True unless a verification ran and its record is not ``verified``."""
        return self.record is None or self.record.get("state") == "verified"

    def to_dict(self) -> dict[str, Any]:
        """The ``add --json`` document (docs/checkpoints.md)."""
        verification, record = self.verification, self.record
        return {
            "checkpoint": self.checkpoint,
            "env": self.env,
            "cluster": self.cluster,
            "downloaded": self.downloaded,
            "download_seconds": self.download_seconds,
            "state": record.get("state", "fetched") if record else "fetched",
            "device": verification.device if verification else None,
            "seconds": verification.seconds if verification else None,
            "message": record.get("message") if record else None,
            "fingerprint": verification.fingerprint if verification else None,
            "checks": verification.checks if verification else None,
            "kwargs": verification.kwargs if verification else None,
        }


def fetch_checkpoint(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    kwargs: dict[str, Any],
    timeout: float = DEFAULT_DOWNLOAD_TIMEOUT,
) -> float:
    """Run the env's download phase in a worker on the CPU with the network allowed."""
    from rootstock.runtime.spawn import run_download

    start = time.monotonic()
    run_download(layout, env_name, checkpoint=checkpoint, setup_kwargs=kwargs, timeout=timeout)
    return time.monotonic() - start


def fetch_and_record(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    kwargs: dict[str, Any],
    timeout: float = DEFAULT_DOWNLOAD_TIMEOUT,
) -> float:
    """Download ``checkpoint`` and stamp it fetched (``add`` and ``sync``); the seconds taken."""
    seconds = fetch_checkpoint(layout, env_name, checkpoint, kwargs, timeout)
    record_fetch(layout, env_name, checkpoint)
    return seconds


def add(
    layout: InstallLayout,
    checkpoint: str,
    *,
    cluster: str | None = None,
    device: str = "cuda",
    kwargs: dict[str, Any] | None = None,
    verify: bool = True,
    verify_timeout: float = DEFAULT_VERIFY_TIMEOUT,
    force: bool = False,
    accept_drift: bool = False,
    step: Reporter = lambda _msg: None,
) -> AddResult:
    """Fetch ``checkpoint`` (unless already fetched) and verify it on ``device``."""
    if is_custom_id(checkpoint):
        raise UsageError(
            f"{checkpoint!r} takes user-supplied weights; there is nothing to add",
            hint="users pass weights=PATH to RootstockCalculator for :custom checkpoints",
        )
    manifest = load_manifest(layout)
    machine = resolve_cluster(layout, cluster, manifest)
    resolved = resolve_checkpoint(layout, checkpoint, machine)
    env = resolved.env
    entry = manifest.get("envs", {}).get(env.name, {}).get("checkpoints", {}).get(checkpoint)
    fetched = bool((entry or {}).get("fetched_at"))
    download_kwargs = dict(env.verify_kwargs.get(checkpoint, {})) if kwargs is None else kwargs
    downloaded, download_seconds = False, None
    with maintainer_umask():
        if force or not fetched:
            step(f"{checkpoint}: downloading on the CPU (network allowed)")
            download_seconds = fetch_and_record(layout, env.name, checkpoint, download_kwargs)
            downloaded = True
        else:
            step(f"{checkpoint}: already fetched; skipping the download")
        if not verify:
            return AddResult(
                checkpoint, env.name, machine, downloaded, download_seconds, None, None
            )
        step(f"{checkpoint}: verifying on {device} (offline)")
        verified = verify_and_record(
            layout,
            env,
            checkpoint,
            machine,
            device=device,
            kwargs=kwargs,
            timeout=verify_timeout,
            accept_drift=accept_drift,
        )
    return AddResult(
        checkpoint,
        env.name,
        machine,
        downloaded,
        download_seconds,
        verified.outcome,
        verified.record,
    )


__all__ = ["AddResult", "RootstockError", "add", "fetch_and_record", "fetch_checkpoint"]
