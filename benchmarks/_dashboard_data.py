"""Synthetic per-cluster manifests for the dashboard benchmark.

Each is one cluster's view of an install (`cluster_view` output, docs/manifest.md):
ten families (envs) sharing the checkpoints, each checkpoint fetched and mostly
verified on the env's current build, with some failed, drifted, stale (verified on an
older build) and fetched-only cells, so the server derives every displayed state.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta

FAMILIES = (
    "mace",
    "chgnet",
    "sevennet",
    "orb",
    "mattersim",
    "equiformer",
    "nequip",
    "allegro",
    "grace",
    "uma",
)
BASE_TIME = datetime(2026, 11, 1, tzinfo=UTC)


def stamp(minutes: float) -> str:
    """An ISO-8601 UTC timestamp ``minutes`` after BASE_TIME, as rootstock writes them."""
    return (BASE_TIME + timedelta(minutes=minutes)).isoformat(timespec="seconds")


def build_info(family: str, cluster: str, generation: int) -> dict:
    """The build fields of ``family``'s env on ``cluster`` (generation 0 is older)."""
    return {
        "build_id": f"{family}-{cluster}-b{generation}",
        "source_hash": f"sha256:{family}{generation:02d}{'0' * 54}",
        "built_at": stamp(-1000 + generation),
        "lock_hash": f"sha256:{family}lock{generation:02d}{'0' * 50}",
    }


def fingerprint(energy: float, kind: str, family: str) -> dict:
    return {
        "energy_per_atom": energy,
        "force_norm": 1.23452,
        "stress": [0.1012, 0.0987, 0.1003, 0.0021, -0.0004, 0.0],
        "natoms": 8,
        "device_kind": kind,
        "torch": "2.4.0",
        "env_versions": {family: "0.3.6", "ase": "3.23.0"},
    }


def verification(state: str, at: str, kind: str, family: str, build: dict) -> dict:
    """One ``verifications[cluster][kind]`` record (docs/manifest.md)."""
    reference = {"fingerprint": fingerprint(-3.91274, kind, family), "at": stamp(0), "build": build}
    drift = None
    message = None
    result = fingerprint(-3.91274, kind, family)
    if state == "failed":
        result, message = None, "RuntimeError: CUDA out of memory (synthetic)"
    elif state == "drifted":
        result = fingerprint(-3.9201, kind, family)
        message = "energy_per_atom moved by 0.0074 eV/atom (synthetic)"
        drift = {
            "within": False,
            "drifts": [
                {
                    "quantity": "energy_per_atom",
                    "reference": -3.91274,
                    "value": -3.9201,
                    "abs_diff": 0.00736,
                    "rel_diff": 0.00188,
                    "allowed": 0.00078,
                    "reason": "beyond tolerance",
                }
            ],
            "message": message,
            "tolerance": {"rtol": 2e-4},
        }
    return {
        "state": state,
        "at": at,
        "device": "cuda:0" if kind == "gpu" else "cpu",
        "device_kind": kind,
        "message": message,
        "fingerprint": result,
        "reference": reference,
        "drift": drift,
        "build": build,
    }


def cell_kind(cluster_index: int, checkpoint_index: int) -> str:
    """The state mix: 75% verified, 7% failed, 6% drifted, 6% stale, 6% fetched only."""
    roll = (cluster_index * 7919 + checkpoint_index * 104729) % 100
    for limit, kind in ((75, "verified"), (82, "failed"), (88, "drifted"), (94, "stale")):
        if roll < limit:
            return kind
    return "fetched"


def synthetic_manifest(cluster_index: int, n_checkpoints: int, round_: int = 0) -> dict:
    """One cluster's view of a manifest with ``n_checkpoints`` over the families.

    ``round_`` > 0 moves the verification time of every tenth checkpoint (a different
    tenth each round), as a later smoke-test push would: new history events.
    """
    cluster = f"bench{cluster_index:02d}"
    per_family = math.ceil(n_checkpoints / len(FAMILIES))
    envs: dict[str, dict] = {}
    for index in range(n_checkpoints):
        family = FAMILIES[index // per_family]
        current = build_info(family, cluster, 1)
        env = envs.setdefault(
            family,
            {
                **current,
                "python": "3.11.9",
                "python_path": "/opt/rootstock/.python/cpython-3.11.9/bin/python3.11",
                "torch": "2.4.0",
                "rootstock": "0.1.0",
                "checkpoints": {},
            },
        )
        kind = cell_kind(cluster_index, index)
        minutes = index * 3 + cluster_index
        if round_ and index % 10 == round_ % 10:
            minutes += 60 * round_
        records: dict[str, dict] = {}
        if kind != "fetched":
            state = "verified" if kind == "stale" else kind
            build = build_info(family, cluster, 0) if kind == "stale" else current
            records["gpu"] = verification(state, stamp(minutes), "gpu", family, build)
            if index % 3 == 0:
                records["cpu"] = verification("verified", stamp(minutes - 5), "cpu", family, build)
        env["checkpoints"][f"{family}-ck{index:03d}"] = {
            "fetched_at": stamp(-500 + index),
            "verifications": {cluster: records} if records else {},
        }
    return {
        "schema_version": 1,
        "clusters": [cluster],
        "created_at": stamp(-2000),
        "updated_at": stamp(60 * round_ + 1000),
        "written_by": "rootstock 0.1.0",
        "envs": envs,
    }


def encode(manifest: dict) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
