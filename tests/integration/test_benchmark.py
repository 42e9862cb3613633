"""``rootstock benchmark`` on real uv-built EMT envs, and the id rule of every command.

One module-scoped root holds the sample EMT env (fetched), the user-weights test env
(``emt-offset-0`` left unfetched on purpose) and the environment probe. Every
command runs as a user would, in a subprocess with a deadline. Timings are only
checked for being positive, never for their size.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from tests.conftest import run_rootstock
from tests.integration.conftest import SAMPLE_EMT, TEST_ENVS, build_real_root

pytestmark = pytest.mark.timeout(600)

TOP_KEYS = {"rootstock", "host", "at", "device", "system", "walk", "results"}
SYSTEM_KEYS = {
    "spec", "kind", "formula", "natoms", "periodic", "structure", "lattice_constant", "repeat",
}  # fmt: skip
RESULT_KEYS = {
    "checkpoint", "env", "calculator", "in_env", "overhead_ms", "overhead_pct",
    "first_energy", "max_energy_diff", "max_force_diff",
}  # fmt: skip
RUN_KEYS = {"calls", "median_ms", "p95_ms", "min_ms", "startup_s", "setup_s"}
QUICK = ("--device", "cpu", "--calls", "5", "--warmup", "2")


@pytest.fixture(scope="module")
def bench_root(tmp_path_factory, shared_uv_cache: Path) -> Path:
    """EMT (fetched), custom-emt (emt-offset-0 not fetched) and the probe (fetched)."""
    root = tmp_path_factory.mktemp("benchmark") / "root"
    envs = {
        "emt": SAMPLE_EMT,
        "custom-emt": TEST_ENVS / "custom_emt.py",
        "probe": TEST_ENVS / "probe.py",
    }
    build_real_root(root, envs, shared_uv_cache)
    for checkpoint in ("emt", "probe"):
        rs(root, "add", checkpoint, "--no-verify", "--no-push", "--no-perm-check")
    return root


def rs(root: Path, *args: str, check: bool = True, timeout: float = 300):
    """Run ``rootstock ARGS --root ROOT``."""
    return run_rootstock(*args, "--root", root, check=check, timeout=timeout)


def bench_json(root: Path, *args: str) -> dict:
    """``rootstock benchmark ARGS --json``, which must succeed and print nothing else."""
    proc = rs(root, "benchmark", *args, "--json")
    assert proc.stderr == "", "--json shows no progress"
    return json.loads(proc.stdout)


def test_emt_json_shape_and_agreement(bench_root: Path):
    doc = bench_json(bench_root, "emt", *QUICK, "--system", "Cu:32")
    assert set(doc) == TOP_KEYS
    assert doc["device"] == "cpu"
    assert set(doc["system"]) == SYSTEM_KEYS
    assert doc["system"]["natoms"] == 32 and doc["system"]["formula"] == "Cu32"
    assert doc["system"]["periodic"] is True and doc["system"]["structure"] == "fcc"
    assert doc["walk"] == {"seed": 42, "step": 0.005, "warmup": 2, "calls": 5}
    (result,) = doc["results"]
    assert set(result) == RESULT_KEYS
    assert result["checkpoint"] == "emt" and result["env"] == "emt"
    for run in ("calculator", "in_env"):
        stats = result[run]
        assert set(stats) == RUN_KEYS
        assert stats["calls"] == 5
        assert 0 < stats["min_ms"] <= stats["median_ms"] <= stats["p95_ms"]
        assert stats["startup_s"] > 0
    assert result["calculator"]["setup_s"] is None and result["in_env"]["setup_s"] > 0
    assert math.isfinite(result["overhead_ms"]) and math.isfinite(result["overhead_pct"])
    # Both runs walked the same path through the same model: the i-PI frames carry
    # Bohr, so only the unit round trip separates them.
    assert result["max_energy_diff"] < 1e-9
    assert result["max_force_diff"] < 1e-9
    # The walk starts from ASE's reference crystal: EMT on it, in this process.
    reference = bulk("Cu", "fcc", a=3.61, cubic=True) * (2, 2, 2)
    reference.calc = EMT()
    assert result["first_energy"] == pytest.approx(reference.get_potential_energy(), abs=1e-9)


def test_human_table_names_both_runs_and_the_real_count(bench_root: Path):
    proc = rs(bench_root, "benchmark", "emt", *QUICK, "--system", "Cu:33")
    out = proc.stdout
    assert "Cu:33: Cu108" in out and "108 atoms" in out and "3x3x3" in out
    for column in ("median ms", "p95 ms", "min ms", "start-up s"):
        assert column in out
    assert "calculator" in out and "in env" in out
    assert "overhead" in out and "energies agree" in out
    assert "RootstockCalculator" in proc.stderr, "progress on stderr"


def test_molecule_is_not_periodic(bench_root: Path):
    doc = bench_json(bench_root, "emt", *QUICK, "--system", "H2O")
    assert doc["system"]["kind"] == "molecule" and doc["system"]["periodic"] is False
    assert doc["system"]["natoms"] == 3
    assert doc["results"][0]["max_energy_diff"] < 1e-9


def test_custom_weights_need_no_fetch(bench_root: Path, tmp_path: Path):
    weights = tmp_path / "offset.json"
    weights.write_text(json.dumps({"offset": 5.0}))
    doc = bench_json(
        bench_root, "emt-offset:custom", "--weights", weights, *QUICK, "--system", "Cu:4"
    )
    (result,) = doc["results"]
    assert result["env"] == "custom-emt" and result["max_energy_diff"] < 1e-9
    plain = bench_json(bench_root, "emt", *QUICK, "--system", "Cu:4")["results"][0]
    assert result["first_energy"] == pytest.approx(plain["first_energy"] + 5.0, abs=1e-9)


CALCULATOR_PROBE = """
import sys
from ase.build import bulk
from rootstock import RootstockCalculator
atoms = bulk("Cu", cubic=True)
with RootstockCalculator(
    "probe", root=sys.argv[1], device="cpu", setup_kwargs={"dump": sys.argv[2]}
) as calc:
    atoms.calc = calc
    atoms.get_potential_energy()
"""


def test_in_env_run_gets_a_workers_environment(bench_root: Path, tmp_path: Path):
    """The probe env's setup() reports what it sees; both runs must see the same."""
    seen_by_worker = tmp_path / "worker.json"
    subprocess.run(
        [sys.executable, "-c", CALCULATOR_PROBE, str(bench_root), str(seen_by_worker)],
        check=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    seen_in_env = tmp_path / "in-env.json"
    kwargs = json.dumps({"dump": str(seen_in_env)})
    bench_json(bench_root, "probe", *QUICK, "--system", "Cu:4", "--setup-kwargs", kwargs)
    worker, in_env = (json.loads(p.read_text()) for p in (seen_by_worker, seen_in_env))
    assert in_env["env"] == worker["env"]
    assert in_env["env"]["HF_HUB_OFFLINE"] == "1" and in_env["env"]["PYTHONPATH"] is None
    assert in_env["env"]["HOME"] == str(bench_root / "home")
    assert in_env["isolated"] == worker["isolated"] == 1
    assert in_env["device"] == "cpu" and in_env["kwargs"] == {}


def test_unknown_ids_exit_2_in_every_command(bench_root: Path):
    for args in (
        ("benchmark", "emtt", "--device", "cpu"),
        ("benchmark", "emt", "emtt", "--device", "cpu"),
        ("add", "emtt", "--no-verify", "--no-push", "--no-perm-check"),
        ("smoke-test", "--checkpoint", "emtt", "--device", "cpu", "--no-push"),
        ("serve", "emtt", "--socket", "/tmp/rootstock-bench-none.sock", "--device", "cpu"),
    ):
        proc = rs(bench_root, *args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "unknown checkpoint 'emtt'" in proc.stderr and "close matches: emt" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_unfetched_ids_exit_1_naming_add(bench_root: Path):
    for args in (
        ("benchmark", "emt-offset-0", "--device", "cpu"),
        ("benchmark", "emt", "emt-offset-0", "--device", "cpu"),
        ("smoke-test", "--checkpoint", "emt-offset-0", "--device", "cpu", "--no-push"),
    ):
        proc = rs(bench_root, *args, check=False)
        assert proc.returncode == 1, (args, proc.stderr)
        assert "not fetched" in proc.stderr
        assert "rootstock add emt-offset-0 --no-verify" in proc.stderr
        assert proc.stdout == "", "nothing ran"


@pytest.mark.parametrize("system", ["Cu:abc", "Xx:8", "Cu:0", "no-such-molecule", "Ti:16", "Cu:"])
def test_system_garbage_exits_2(bench_root: Path, system: str):
    proc = rs(bench_root, "benchmark", "emt", "--device", "cpu", "--system", system, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: --system {system!r}")
    assert "El:N" in proc.stderr and "molecule name" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--setup-kwargs", "{bad"), "--setup-kwargs is not valid JSON"),
        (("--setup-kwargs", "[1]"), "--setup-kwargs must be a JSON object"),
        (("--setup-kwargs", '{"device": "cpu"}'), "may not set device"),
        (("--calls", "0"), "--calls"),
        (("--weights", "/nonexistent"), "only for <family>:custom"),
    ],
)
def test_bad_options_exit_2(bench_root: Path, args, message):
    proc = rs(bench_root, "benchmark", "emt", "--device", "cpu", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
