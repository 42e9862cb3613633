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
``stale``        the env was rebuilt or hotfixed since the last verification
===============  ===========================================================
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

DISPLAY_STATES = ("not fetched", "fetched", "verified", "failed", "drifted", "stale")


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
    checks: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the shape ``status --json`` uses per cell)."""
        # A shallow copy is enough (``checks`` is the reader's own manifest data, which
        # it only serialises); asdict() deep-copies and costs a third of `status` on a
        # large install.
        return dict(self.__dict__)


def checkpoint_state(
    manifest: dict[str, Any],
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
    env = manifest.get("envs", {}).get(env_name) or {}
    entry = env.get("checkpoints", {}).get(checkpoint) or {}
    fetched_at = entry.get("fetched_at")
    by_kind = entry.get("verifications", {}).get(cluster) or {}
    record = _pick_record(by_kind, device_kind)
    if record is None:
        state = "fetched" if fetched_at else "not fetched"
        return CheckpointState(state, cluster, device_kind, fetched_at=fetched_at)
    at = record.get("at")
    recorded = record.get("state")
    stale_reason = _stale_reason(record.get("build") or {}, env, current_source_hash)
    base = {
        "cluster": cluster,
        "device_kind": record.get("device_kind"),
        "device": record.get("device"),
        "at": at,
        "age_s": _age_seconds(at, now),
        "fetched_at": fetched_at,
        "recorded_state": recorded,
        "checks": record.get("checks") if isinstance(record.get("checks"), dict) else None,
    }
    if stale_reason:
        return CheckpointState("stale", message=stale_reason, **base)
    state = recorded if recorded in ("verified", "failed", "drifted") else "failed"
    return CheckpointState(state, message=record.get("message"), **base)


def _pick_record(by_kind: dict[str, Any], device_kind: str | None) -> dict[str, Any] | None:
    if device_kind is not None:
        return by_kind.get(device_kind)
    records = [r for r in by_kind.values() if isinstance(r, dict)]
    if not records:
        return None
    return max(records, key=lambda r: parse_time(r.get("at")) or datetime.min.replace(tzinfo=UTC))


def _stale_reason(
    build: dict[str, Any], env: dict[str, Any], current_source_hash: str | None
) -> str | None:
    if not build.get("source_hash"):
        return "verified against an unrecorded build; re-verify"
    if any(build.get(f) != env.get(f) for f in ("build_id", "built_at", "lock_hash")):
        return "env rebuilt since verification; re-verify (rootstock smoke-test)"
    current = current_source_hash or env.get("source_hash")
    if current and build.get("source_hash") != current:
        return "env_source.py changed since verification (hotfix); re-verify"
    return None


def parse_time(text: Any) -> datetime | None:
    """A manifest timestamp as an aware datetime (no offset means UTC); None if unreadable."""
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _age_seconds(at: Any, now: datetime | None) -> float | None:
    moment = parse_time(at)
    if moment is None:
        return None
    return max(0.0, ((now or datetime.now(UTC)) - moment).total_seconds())


def cluster_view(manifest: dict[str, Any], cluster: str) -> dict[str, Any]:
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
