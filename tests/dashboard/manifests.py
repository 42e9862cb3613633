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


def checks(forces: float = 1.0, stress: float | None = 1.0, forces_mode: str = "gradient"):
    """A record's physics checks as ``rootstock add`` writes them (docs/manifest.md)."""

    def quantity(name: str, ratio: float | None, mode: str) -> dict[str, Any]:
        if ratio is None:
            return {"mode": "n/a", "ok": True, "ratio": None, "cosine": None,
                    "norm_ratio": None, "tol": {}, "directions": 0,
                    "message": "not checked: the structure is not 3-D periodic"}  # fmt: skip
        ok = abs(ratio - 1) <= 0.02 if mode == "gradient" else 0.5 <= ratio <= 2
        what = "negative gradient" if name == "forces" else "strain derivative"
        return {
            "mode": mode,
            "ok": ok,
            "ratio": ratio,
            "cosine": 1.0 if ratio > 0 else -1.0,
            "norm_ratio": abs(ratio),
            "tol": {"ratio": 0.02, "rule": "float64"},
            "directions": 3,
            "message": None if ok else f"{name}: {ratio:.4g}× the {what} of the energy",
        }

    forces_check = quantity("forces", forces, forces_mode)
    stress_check = quantity("stress", stress, "gradient")
    return {
        "ok": forces_check["ok"] and stress_check["ok"],
        "dtype": "float64",
        "model_dtype": "float64",
        "step": 0.001,
        "energy": "smooth",
        "energy_calls": 8,
        "seconds": 0.1,
        "forces": forces_check,
        "stress": stress_check,
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
