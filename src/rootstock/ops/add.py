"""``rootstock add``: fetch a checkpoint's weights, then verify them.

The two phases can run on different nodes. *Download* runs on the CPU with the
network allowed: it calls the env's ``download()`` hook, or ``setup()`` on the
CPU, so the weights land in the cache root. *Verify* runs on ``--device`` with
``HF_HUB_OFFLINE=1``. A re-run skips the download when the manifest says the
checkpoint is fetched, and verifies again.

The download also records which files the checkpoint owns (the record's
``files``, which ``prune`` reference-counts): the paths the ``download()`` hook
returned, plus whatever appeared or changed under ``cache/`` and ``home/`` while
it ran (a scan before and after). Each weight file among them is hashed just after
the fetch (size, sha256, mtime: the record's ``weights``), and a re-run of ``add``
on a fetched checkpoint hashes them again and records what is on disk, which is how
a changed (``tampered``) file is accepted (:mod:`rootstock.ops.integrity`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import RootstockError, UsageError
from rootstock.install import Reporter
from rootstock.install.envfile import is_custom_id
from rootstock.install.envs import load_installed_env, resolve_checkpoint
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import resolve_cluster
from rootstock.install.manifest import Verification, load_manifest, record_fetch
from rootstock.install.perms import maintainer_umask
from rootstock.install.weights import weigh_files
from rootstock.ops.integrity import accept_weights
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
    #: The checkpoint record's ``files`` after this add; None: unattributed.
    files: list[str] | None = None

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
            "files": None if self.files is None else len(self.files),
        }


@dataclass(frozen=True)
class FetchResult:
    """One download: how long it took, and the files its record now lists."""

    seconds: float
    #: The record's ``files`` after the merge (relative to the cache root); None when
    #: the record is unattributed (more files than a record may list).
    files: list[str] | None = field(default=None)


# (inode, mtime in ns, size) of one file or symlink: a change in any is "brought".
_Stat = tuple[int, int, int]
# The top-level folders of the cache root that downloads write to.
_CACHE_TOPS = ("cache", "home")


def fetch_checkpoint(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    kwargs: dict[str, Any],
    timeout: float = DEFAULT_DOWNLOAD_TIMEOUT,
) -> tuple[float, list[str]]:
    """Run the env's download phase in a worker on the CPU with the network allowed.

    Returns the seconds taken and the paths the ``download()`` hook returned. A
    checkpoint whose ``CHECKPOINT_INFO`` says it is gated is refused before the
    worker starts when no Hugging Face token is found.
    """
    from rootstock.runtime import run_download

    gated_url = load_installed_env(layout, env_name).gated_url(checkpoint)
    start = time.monotonic()
    returned = run_download(
        layout,
        env_name,
        checkpoint=checkpoint,
        setup_kwargs=kwargs,
        timeout=timeout,
        gated_url=gated_url,
    )
    return time.monotonic() - start, returned


def fetch_and_record(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    kwargs: dict[str, Any],
    timeout: float = DEFAULT_DOWNLOAD_TIMEOUT,
) -> FetchResult:
    """Download ``checkpoint``, stamp it fetched and record its files (``add``, ``sync``).

    The files are those the hook returned and those that appeared or changed under
    ``cache/`` and ``home/`` during the download; each weight file among them is
    hashed (size, sha256, mtime) before the record is written. A download running at the same
    time into the same cache root (another ``add``, ``sync --jobs``) may have its
    files attributed here too: over-attribution only keeps files longer, since
    ``prune`` deletes a file only when no surviving checkpoint lists it.
    """
    before = scan_cache(layout)
    seconds, returned = fetch_checkpoint(layout, env_name, checkpoint, kwargs, timeout)
    files = attributed_files(layout, before, scan_cache(layout), returned)
    weights, _gone = weigh_files(layout.cache_root, files)
    record = record_fetch(layout, env_name, checkpoint, files=files, weights=weights)
    return FetchResult(seconds, record.get("files"))


def scan_cache(layout: InstallLayout) -> dict[str, _Stat]:
    """Every file and symlink under ``cache/`` and ``home/`` of the cache root.

    Symlinks are listed, never followed (a symlink to a directory is one entry).
    Unreadable directories are skipped: the scan only adds attribution.
    """
    found: dict[str, _Stat] = {}
    for top in _CACHE_TOPS:
        for path in _walk_entries(layout.cache_root / top):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            found[path] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return found


def attributed_files(
    layout: InstallLayout,
    before: dict[str, _Stat],
    after: dict[str, _Stat],
    returned: Iterable[str],
) -> list[str]:
    """The files a download brought, relative to the cache root, sorted and unique.

    Those new or changed between the scans ``before`` and ``after``, plus each
    returned path: a file or symlink as itself, a directory as everything under
    it. A symlink inside the cache root brings its target too (a Hugging Face
    snapshot link and the blob it points to), so a blob is never attributed to
    one checkpoint while another's link needs it. Paths outside ``cache/`` and
    ``home/`` of the cache root are ignored.
    """
    attribution = _Attribution(layout.cache_root)
    for path, stat in after.items():
        if before.get(path) != stat:
            attribution.add(path)
    for path in returned:
        attribution.add(path)
    return sorted(attribution.files)


class _Attribution:
    """Collects cache-root-relative paths, following links and directories once."""

    def __init__(self, cache_root: Path) -> None:
        self.roots = tuple(
            dict.fromkeys((os.path.abspath(cache_root), os.path.realpath(cache_root)))
        )
        self.files: set[str] = set()
        self._walked: set[str] = set()

    def add(self, path: str) -> None:
        relative = self.relative(path)
        if relative is None:
            return
        if os.path.islink(path):
            self.files.add(relative)
            target = os.path.realpath(path)
            if self.relative(target) is not None:
                self.add(target)
        elif os.path.isdir(path):
            self._walk(path)
        elif os.path.lexists(path):
            self.files.add(relative)

    def _walk(self, directory: str) -> None:
        real = os.path.realpath(directory)
        if real in self._walked:
            return
        self._walked.add(real)
        for entry in _walk_entries(Path(directory)):
            self.add(entry)

    def relative(self, path: str) -> str | None:
        """``path`` relative to the cache root, if it lies under ``cache/`` or ``home/``."""
        absolute = os.path.abspath(path)
        # The last component stays unresolved: a symlink is attributed as itself.
        candidates = (
            absolute,
            os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute)),
        )
        for candidate in candidates:
            for root in self.roots:
                if not candidate.startswith(root.rstrip(os.sep) + os.sep):
                    continue
                parts = Path(candidate[len(root.rstrip(os.sep)) + 1 :]).parts
                if len(parts) > 1 and parts[0] in _CACHE_TOPS:
                    return _storable("/".join(parts))
        return None


def _storable(relative: str) -> str | None:
    """``relative`` if the manifest can hold it: a name that is not UTF-8 (decoded
    with surrogate escapes) cannot be written as JSON text, so it stays unattributed."""
    try:
        relative.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return relative


def _walk_entries(top: Path) -> Iterable[str]:
    """Paths of the files and symlinks under ``top``, not following directory links."""
    for dirpath, dirnames, filenames in os.walk(top):
        yield from (os.path.join(dirpath, name) for name in filenames)
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                yield path


def add(
    layout: InstallLayout,
    checkpoint: str,
    *,
    cluster: str | None = None,
    device: str = "cuda",
    kwargs: dict[str, Any] | None = None,
    verify: bool = True,
    verify_timeout: float = DEFAULT_VERIFY_TIMEOUT,
    download_timeout: float = DEFAULT_DOWNLOAD_TIMEOUT,
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
    files: list[str] | None = (entry or {}).get("files")
    with maintainer_umask():
        if force or not fetched:
            step(f"{checkpoint}: downloading on the CPU (network allowed)")
            fetch = fetch_and_record(
                layout, env.name, checkpoint, download_kwargs, download_timeout
            )
            download_seconds, files, downloaded = fetch.seconds, fetch.files, True
        else:
            step(f"{checkpoint}: already fetched; skipping the download")
            # Accept the files as they are now: a re-run of add is how a changed
            # (tampered) weight file becomes the recorded one.
            step(f"{checkpoint}: hashing its weight files")
            accept_weights(layout, env.name, checkpoint, files)
        if not verify:
            return AddResult(
                checkpoint, env.name, machine, downloaded, download_seconds, None, None, files
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
        files,
    )


__all__ = [
    "AddResult",
    "FetchResult",
    "RootstockError",
    "add",
    "attributed_files",
    "fetch_and_record",
    "fetch_checkpoint",
    "scan_cache",
]
