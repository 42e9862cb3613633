"""Synthetic manifests shaped like ``cluster_view`` output, for the dashboard tests.

Built by hand (not by running installs) so a test can say exactly which cells are
verified, failed, drifted, stale or fetched only.
"""

from __future__ import annotations

import copy
from typing import Any

SCHEMA_VERSION = 1


def build(env: str, built_at: str = "2026-11-01T08:00:00+00:00") -> dict[str, Any]:
    """An env's build reference (what a verification record's ``build`` names)."""
    return {
        "build_id": f"{env}-build",
        "source_hash": f"sha256:{env}",
        "built_at": built_at,
        "lock_hash": f"sha256:{env}-lock",
    }


def record(
    env: str,
    state: str = "verified",
    at: str = "2026-11-28T10:00:00+00:00",
    kind: str = "gpu",
    message: str | None = None,
    energy: float | None = -3.9,
) -> dict[str, Any]:
    """One verification record, run against ``env``'s default build."""
    return {
        "state": state,
        "at": at,
        "device": "cuda:0" if kind == "gpu" else kind,
        "device_kind": kind,
        "message": message,
        "fingerprint": None if state == "failed" else {"energy_per_atom": energy},
        "reference": None,
        "drift": None,
        "build": build(env),
    }


def manifest(
    cluster: str,
    envs: dict[str, dict[str, dict[str, Any] | None]],
    python: str = "3.11.9",
    torch: str | None = "2.4.0",
) -> dict[str, Any]:
    """A one-cluster manifest.

    ``envs`` maps env name -> checkpoint id -> ``{kind: record}`` (its verifications
    on ``cluster``), ``{}`` for fetched but never verified, or None for not fetched.
    """
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "clusters": [cluster],
        "created_at": "2026-11-01T07:00:00+00:00",
        "updated_at": "2026-11-28T10:00:00+00:00",
        "written_by": "rootstock 0.1.0",
        "envs": {},
    }
    for env, checkpoints in envs.items():
        entry = {
            **build(env),
            "python": python,
            "python_path": "/usr/bin/python3",
            "torch": torch,
            "rootstock": "0.1.0",
            "checkpoints": {},
        }
        for checkpoint, records in checkpoints.items():
            entry["checkpoints"][checkpoint] = {
                "fetched_at": None if records is None else "2026-11-02T09:00:00+00:00",
                "verifications": {cluster: copy.deepcopy(records)} if records else {},
            }
        out["envs"][env] = entry
    return out


def large(cluster: str, families: int = 10, per_family: int = 30) -> dict[str, Any]:
    """A ``families`` x ``per_family`` manifest, every checkpoint verified on GPU."""
    return manifest(
        cluster,
        {
            f"fam{f:02d}": {
                f"fam{f:02d}-ckpt{c:03d}": {"gpu": record(f"fam{f:02d}")} for c in range(per_family)
            }
            for f in range(families)
        },
    )
