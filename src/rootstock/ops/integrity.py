"""The bytes are the bytes that were verified: weight files at ``add`` and before each
verification.

``add`` (and ``sync``'s download) records each weight file's size, sha256 and mtime
just after the fetch (:func:`record_fetched_weights`, :func:`accept_weights`).
``smoke-test`` and ``sync`` call :func:`recheck_weights` before the forward pass: it
compares size and mtime and re-hashes a file only when they changed, or every file
with ``--rehash`` or when a worker start marked the checkpoint; a changed file
fails the checkpoint as ``tampered`` without starting a model.

A file that changes while a verification's worker runs is the model's own state (a
cache or log its ``setup()`` rewrites on each start), not weights: the verification
drops it from ``weights`` (:func:`drop_rewritten_weights`), and it stays in ``files``
for ``prune``. Otherwise every verification after the first would find it changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rootstock.install.envs import recorded_weights
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import CheckpointRecord, load_manifest, record_weights
from rootstock.install.weights import (
    WeightCheck,
    check_weights,
    clear_reverification_mark,
    describe_change,
    marked_for_reverification,
    weigh_files,
)


@dataclass(frozen=True)
class Recheck:
    """What the re-check before a verification found: ``problem`` is the ``tampered``
    message, None when every recorded file is as ``add`` recorded it."""

    check: WeightCheck
    problem: str | None
    rehashed: bool


def accept_weights(
    layout: InstallLayout, env_name: str, checkpoint: str, files: list[str] | None
) -> CheckpointRecord | None:
    """Hash the files the record lists and record them (``add`` on a fetched checkpoint).

    This is how ``add`` accepts a changed file: the new bytes become the recorded ones,
    and a listed file that is gone loses its entry. None for an unattributed record.
    """
    if files is None:
        return None
    weights, gone = weigh_files(layout.cache_root, files)
    return record_weights(layout, env_name, checkpoint, weights, gone)


def recheck_weights(
    layout: InstallLayout, env_name: str, checkpoint: str, *, rehash: bool = False
) -> Recheck:
    """Re-check ``checkpoint``'s recorded weight files before its verification.

    Re-hashes every file with ``rehash`` or when a worker start marked the
    checkpoint, otherwise only those whose size or mtime changed. A file whose
    mtime moved but whose bytes did not gets its new mtime recorded, and the marker
    is removed once the check has run. A record without ``weights`` (fetched before
    they were recorded) passes: there is nothing to compare with.
    """
    entry = load_manifest(layout).get("envs", {}).get(env_name, {}).get("checkpoints", {})
    recorded = (entry.get(checkpoint) or {}).get("weights") or {}
    marked = marked_for_reverification(layout, env_name, checkpoint)
    full = rehash or marked
    check = check_weights(layout.cache_root, recorded, rehash=full)
    if check.refreshed and check.ok:
        record_weights(layout, env_name, checkpoint, check.refreshed)
    if marked:
        clear_reverification_mark(layout, env_name, checkpoint)
    problem = None if check.ok else describe_change(checkpoint, check.changed)
    return Recheck(check, problem, full)


WeightStats = dict[str, tuple[int, float] | None]


def weight_stats(layout: InstallLayout, env_name: str, checkpoint: str) -> WeightStats:
    """Size and mtime now of each recorded weight file (None: gone): a stat each."""
    stats: WeightStats = {}
    for relative in recorded_weights(layout, env_name, checkpoint):
        try:
            info = os.stat(layout.cache_root / relative)
        except OSError:
            stats[relative] = None
            continue
        stats[relative] = (info.st_size, info.st_mtime)
    return stats


def drop_rewritten_weights(
    layout: InstallLayout, env_name: str, checkpoint: str, before: WeightStats
) -> list[str]:
    """Drop from ``weights`` the recorded files whose size or mtime changed since
    ``before`` (taken just before a verification's worker started): the model wrote
    them itself. Returns their paths; the record's ``files`` keep them."""
    now = weight_stats(layout, env_name, checkpoint)
    rewritten = sorted(path for path, stat in before.items() if now.get(path, stat) != stat)
    if rewritten:
        record_weights(layout, env_name, checkpoint, {}, rewritten)
    return rewritten
