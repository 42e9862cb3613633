"""A cheap look at a checkpoint's weight files when its worker starts.

``add`` recorded each weight file's size, sha256 and mtime. A worker start compares
size and mtime only (a ``stat`` per file, no read), and on a mismatch logs a warning
and leaves a marker (``{root}/.reverify/``) asking the next ``smoke-test`` or
``sync`` to re-hash that checkpoint in full. It never refuses to start: a
maintainer's copy in progress must not block users, and verification is where a
changed file fails (as ``tampered``). Nothing here may fail a start: a manifest that
cannot be read, a file that cannot be stat'ed or a marker that cannot be written
(a user who may not write the root, a read-only filesystem) costs at most a warning.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from datetime import UTC, datetime

from rootstock.install.envs import recorded_weights
from rootstock.install.layout import InstallLayout

log = logging.getLogger("rootstock.runtime")


def changed_weight_files(layout: InstallLayout, env_name: str, checkpoint: str) -> list[str]:
    """The recorded weight files whose size or mtime differ now (or that are gone)."""
    changed = []
    for relative, entry in sorted(recorded_weights(layout, env_name, checkpoint).items()):
        try:
            info = os.stat(layout.cache_root / relative)
        except OSError:
            changed.append(relative)
            continue
        if info.st_size != entry.get("size") or info.st_mtime != entry.get("mtime"):
            changed.append(relative)
    return changed


def check_weights_at_start(layout: InstallLayout, env_name: str, checkpoint: str) -> list[str]:
    """Warn about, and mark, weight files changed since ``add``; return their paths.

    Never raises: whatever goes wrong here is logged at debug level and the worker
    starts as it would have.
    """
    try:
        changed = changed_weight_files(layout, env_name, checkpoint)
    except Exception as exc:  # a look-out must never fail the start
        log.debug("weight files of %s not checked: %s", checkpoint, exc)
        return []
    if not changed:
        return changed
    more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
    try:
        _mark(layout, env_name, checkpoint, changed)
        marked = "marked for re-verification by the next smoke-test or sync"
    except Exception as exc:  # marking is a courtesy, never a failure
        marked = f"not marked for re-verification ({exc})"
    log.warning(
        "weights of %s changed since add (%s%s: size or mtime differ); starting anyway, %s",
        checkpoint,
        changed[0],
        more,
        marked,
    )
    return changed


def _mark(layout: InstallLayout, env_name: str, checkpoint: str, changed: list[str]) -> None:
    """Leave the marker :func:`rootstock.install.weights.marked_for_reverification` reads.

    Written to a temporary name and renamed, so a reader never sees half of it; a
    marker already there is kept (one is enough). Never touches the manifest.
    """
    marker = layout.reverify_marker(env_name, checkpoint)
    if marker.exists():
        return
    marker.parent.mkdir(exist_ok=True)
    body = {
        "env": env_name,
        "checkpoint": checkpoint,
        "files": changed[:20],
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    temporary = marker.with_name(f".{marker.name}.{secrets.token_hex(6)}")
    try:
        with open(temporary, "x", encoding="utf-8") as handle:
            json.dump(body, handle)
        os.replace(temporary, marker)
    finally:
        if temporary.exists():
            temporary.unlink()
