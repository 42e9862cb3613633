"""``rootstock benchmark`` on CHGNet: a real model through the worker and in its env.

``chgnet-0.3.0`` is fetched first (its weights ship in the wheel, so the fetch is
quick), into a root of the module's own: a copy of the run's shared CHGNet env
(tests/mlip/private_root.py), since a fetch writes the manifest and the shared root
is used by other processes of the run at the same time. Both runs get the same thread
count, and the energies of the two runs of the seeded walk must agree: the same model
on the same geometries. Timings are only checked for being positive.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import run_rootstock
from tests.mlip.family import THREADS
from tests.mlip.private_root import private_family_root

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1800)]

RUN_KEYS = {"calls", "median_ms", "p95_ms", "min_ms", "startup_s", "setup_s"}


def rs(root: Path, *args: str, check: bool = True, timeout: float = 1500):
    """Run ``rootstock ARGS --root ROOT`` with the test's thread count."""
    return run_rootstock(*args, "--root", root, env=THREADS, check=check, timeout=timeout)


@pytest.fixture(scope="module")
def chgnet_root(mlip_root: Path, user_uv_cache: Path, tmp_path_factory) -> Path:
    """A root of the module's own with the CHGNet env and only ``chgnet-0.3.0`` fetched."""
    path = tmp_path_factory.mktemp("benchmark") / "root"
    private_family_root(mlip_root, path, ("chgnet",), user_uv_cache)
    rs(path, "add", "chgnet-0.3.0", "--no-verify", "--no-push", "--no-perm-check")
    return path


def test_chgnet_benchmark_json(chgnet_root: Path):
    proc = rs(
        chgnet_root,
        "benchmark",
        "chgnet-0.3.0",
        "--device",
        "cpu",
        "--calls",
        "5",
        "--warmup",
        "1",
        "--system",
        "Cu:32",
        "--json",
    )
    doc = json.loads(proc.stdout)
    assert doc["device"] == "cpu" and doc["walk"]["calls"] == 5
    assert doc["system"]["natoms"] == 32 and doc["system"]["periodic"] is True
    (result,) = doc["results"]
    assert result["checkpoint"] == "chgnet-0.3.0" and result["env"] == "chgnet"
    for run in ("calculator", "in_env"):
        stats = result[run]
        assert set(stats) == RUN_KEYS and stats["calls"] == 5
        assert 0 < stats["min_ms"] <= stats["median_ms"] <= stats["p95_ms"]
        assert stats["startup_s"] > 0
    assert result["in_env"]["setup_s"] > 0
    assert math.isfinite(result["overhead_ms"])
    # CHGNet on the CPU is deterministic: the same walk gives the same energies.
    assert math.isfinite(result["first_energy"]) and result["first_energy"] < 0
    assert result["max_energy_diff"] < 1e-5, result
    assert result["max_force_diff"] < 1e-4, result


def test_chgnet_id_rule(chgnet_root: Path):
    proc = rs(chgnet_root, "benchmark", "chgnet-0.3.1", "--device", "cpu", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "close matches: chgnet-0.3.0" in proc.stderr and "Traceback" not in proc.stderr

    proc = rs(
        chgnet_root, "benchmark", "chgnet-0.3.0", "--system", "Cu:abc", "--device", "cpu",
        check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "El:N" in proc.stderr

    manifest = json.loads((chgnet_root / "manifest.json").read_text())
    recorded = manifest["envs"]["chgnet"]["checkpoints"]
    assert not (recorded.get("chgnet-r2scan") or {}).get("fetched_at"), (
        "only chgnet-0.3.0 is fetched in the module's root"
    )
    proc = rs(chgnet_root, "benchmark", "chgnet-r2scan", "--device", "cpu", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "rootstock add chgnet-r2scan --no-verify" in proc.stderr
