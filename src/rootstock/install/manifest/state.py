"""The displayed state of a checkpoint, derived from the manifest (pure functions).

Nothing here is stored: ``stale`` in particular is computed on every read by
comparing the build a verification ran against with the env's current build and the
live hash of ``envs/<env>/env_source.py``, so a hotfix shows up without anyone
having to remember to mark anything.

===============  ===========================================================
state            meaning
===============  ===========================================================
``not fetched``  no weights recorded for this checkpoint
``fetched``      weights in the cache, never verified on this cluster/kind
``verified``     last pass matched the reference fingerprint (with its age)
``failed``       last verification failed (with a one-line reason)
``drifted``      last pass ran, but moved beyond tolerance from the reference
``tampered``     a weight file changed since ``add`` recorded it; the model never ran
``stale``        the env was rebuilt or hotfixed since the last verification
===============  ===========================================================
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rootstock.install.manifest.types import BuildRef, Checks, EnvRecord, Manifest, Verification

DISPLAY_STATES = (
    "not fetched",
    "fetched",
    "verified",
    "failed",
    "drifted",
    "tampered",
    "stale",
)


@dataclass(frozen=True)
class CheckpointState:
    """One cell of the ``status`` grid: a checkpoint on one cluster (and device kind).

    ``recorded_state`` is the stored verification state under a ``stale`` (or the
    state itself otherwise); ``message`` is the failure reason, the drift summary,
    or why the record is stale; ``checks`` is the record's physics checks (forces
    and stress against the energy), None for a record from before they existed.
    """

    state: str
    cluster: str
    device_kind: str | None = None
    device: str | None = None
    at: str | None = None
    age_s: float | None = None
    fetched_at: str | None = None
    message: str | None = None
    recorded_state: str | None = None
    checks: Checks | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the shape ``status --json`` uses per cell)."""
        # A shallow copy is enough (``checks`` is the reader's own manifest data, which
        # it only serialises); asdict() deep-copies and costs a third of `status` on a
        # large install.
        return dict(self.__dict__)


def checkpoint_state(
    manifest: Manifest,
    env_name: str,
    checkpoint: str,
    cluster: str,
    device_kind: str | None = None,
    current_source_hash: str | None = None,
    now: datetime | None = None,
) -> CheckpointState:
    """Derive the state of ``checkpoint`` (served by ``env_name``) on ``cluster``.

    ``device_kind`` picks the record for that kind ("cpu", "gpu", "xpu"); None takes
    the most recent record of any kind. ``current_source_hash`` is the hash of the
    live ``env_source.py`` (the caller reads it, so a hotfix not yet verified shows
    as stale); None falls back to the env's recorded ``source_hash``.
    """
    cluster = cluster.strip().lower()
    env: EnvRecord = manifest.get("envs", {}).get(env_name) or {}
    entry = env.get("checkpoints", {}).get(checkpoint) or {}
    fetched_at = entry.get("fetched_at")
    by_kind = entry.get("verifications", {}).get(cluster) or {}
    record = _pick_record(by_kind, device_kind)
    if record is None:
        shown = "fetched" if fetched_at else "not fetched"
        return CheckpointState(shown, cluster, device_kind, fetched_at=fetched_at)
    at = record.get("at")
    recorded = record.get("state")
    checks = record.get("checks")
    stale_reason = _stale_reason(record.get("build") or {}, env, current_source_hash)
    message: str | None
    if stale_reason:
        state, message = "stale", stale_reason
    else:
        # A pushed record may say anything (the dashboard reads it too).
        state = "failed" if recorded is None or recorded not in _RECORDED_STATES else recorded
        message = record.get("message")
    # Positional: status builds thousands of these, and keywords cost a third more.
    return CheckpointState(
        state,
        cluster,
        record.get("device_kind"),
        record.get("device"),
        at,
        _age_seconds(at, now),
        fetched_at,
        message,
        recorded,
        checks if isinstance(checks, dict) else None,
    )


_RECORDED_STATES = ("verified", "failed", "drifted", "tampered")
_NEVER = datetime.min.replace(tzinfo=UTC)


def _pick_record(by_kind: dict[str, Verification], device_kind: str | None) -> Verification | None:
    if device_kind is not None:
        return by_kind.get(device_kind)
    latest, latest_at = None, _NEVER
    for record in by_kind.values():
        if isinstance(record, dict):
            moment = parse_time(record.get("at")) or _NEVER
            if latest is None or moment > latest_at:
                latest, latest_at = record, moment
    return latest


def _stale_reason(build: BuildRef, env: EnvRecord, current_source_hash: str | None) -> str | None:
    if not build.get("source_hash"):
        return "verified against an unrecorded build; re-verify"
    get, env_get = build.get, env.get
    if (
        get("build_id") != env_get("build_id")
        or get("built_at") != env_get("built_at")
        or get("lock_hash") != env_get("lock_hash")
    ):
        return "env rebuilt since verification; re-verify (rootstock smoke-test)"
    current = current_source_hash or env.get("source_hash")
    if current and build.get("source_hash") != current:
        return "env_source.py changed since verification (hotfix); re-verify"
    return None


def parse_time(text: Any) -> datetime | None:
    """A manifest timestamp as an aware datetime (no offset means UTC); None if unreadable.

    This is the rule for every timestamp the manifest stores: reading refuses a
    file whose timestamp this cannot read (:mod:`.validate`).
    """
    if not isinstance(text, str):
        return None
    # No ISO-8601 timestamp is this long; a longer text stays out of the cache.
    return _cached_parse_time(text) if len(text) <= 64 else _parse_time_text(text)


def _parse_time_text(text: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


# A manifest repeats a few timestamps thousands of times (every record of one
# smoke-test run, every build stamp), and ``status`` reads each of them several
# times (the check on read, the latest record of a cell, its age).
_cached_parse_time = functools.lru_cache(maxsize=4096)(_parse_time_text)


def _age_seconds(at: Any, now: datetime | None) -> float | None:
    moment = parse_time(at)
    if moment is None:
        return None
    return max(0.0, ((now or datetime.now(UTC)) - moment).total_seconds())


def cluster_view(manifest: Manifest, cluster: str) -> Manifest:
    """A copy of ``manifest`` as one cluster sees it: only that cluster's verifications.

    Build and fetch state is shared by every cluster of a shared install; pushes send
    one such view per cluster.
    """
    cluster = cluster.strip().lower()
    view = copy.deepcopy(manifest)
    view["clusters"] = [cluster]
    for env in view.get("envs", {}).values():
        for entry in env.get("checkpoints", {}).values():
            verifications = entry.get("verifications", {})
            entry["verifications"] = (
                {cluster: verifications[cluster]} if cluster in verifications else {}
            )
    return view
