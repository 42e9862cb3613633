"""``RootstockCalculator.provenance`` and ``evaluate(..., provenance=True)`` on a real
EMT worker, each field checked against the install's own files.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk

import rootstock
from rootstock.parallel.evaluation import Evaluation
from rootstock.runtime import RootstockCalculator
from tests.integration.conftest import TEST_CLUSTER

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(300)]


def cu(seed: int):
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=seed)
    return atoms


def locked_versions(lockfile: Path, package: str) -> set[str]:
    """The versions a uv script lock holds for ``package`` (one per Python at most)."""
    lock = tomllib.loads(lockfile.read_text())
    return {p["version"] for p in lock["package"] if p["name"] == package}


@pytest.mark.parametrize(
    ("cluster", "env", "dependencies"),
    [
        (None, "emt", ["ase", "numpy"]),
        # The test cluster's CLUSTERS variant serves emt there: its build is the one named.
        (TEST_CLUSTER, "emt-variant", ["ase"]),
    ],
)
def test_every_field_comes_from_the_install_and_the_worker(
    fake_built_root: Path, cluster: str | None, env: str, dependencies: list[str]
):
    env_dir = fake_built_root / "envs" / env
    lockfile = env_dir / "env_source.py.lock"
    assert lockfile.is_file()  # a real build: the lock is what is hashed
    built = json.loads((env_dir / "rootstock-env.json").read_text())
    packages: dict[str, str | None] = {}
    for name in dependencies:
        locked = locked_versions(lockfile, name)
        # A package locked once per Python: the version this build installed.
        packages[name] = locked.pop() if len(locked) == 1 else built["versions"][name]
        assert packages[name] in locked_versions(lockfile, name)
    packages["torch"] = None  # EMT's envs have no torch, and say so rather than guess
    with RootstockCalculator("emt", root=fake_built_root, cluster=cluster, device="cpu") as calc:
        before = calc.provenance
        assert calc.worker_pid is None  # reading it started no worker
        assert before["device"] is None  # known only once the worker reported its model
        assert "provenance" not in calc.parameters
        atoms = cu(0)
        atoms.calc = calc
        atoms.get_potential_energy()
        after = calc.provenance
    assert after == {
        "checkpoint": "emt",
        "env": env,
        "build_id": built["build_id"],
        "lockfile_sha256": hashlib.sha256(lockfile.read_bytes()).hexdigest(),
        "packages": packages,
        "weights": {},  # nothing recorded by add for this checkpoint
        "rootstock_version": rootstock.__version__,
        "cluster": cluster,
        "device": "cpu",
    }
    assert before == {**after, "device": None}
    # Where ASE and quacc keep the calculator's metadata, after the calculation.
    assert calc.parameters["provenance"] == after
    json.dumps(after)  # plain JSON, as the integrations store it


def test_it_is_read_once_per_calculator(fake_built_root: Path, monkeypatch):
    from rootstock.runtime import calculator as calculator_module

    calls = []
    real = calculator_module.build_provenance

    def counting(spec):
        calls.append(spec.checkpoint)
        return real(spec)

    monkeypatch.setattr(calculator_module, "build_provenance", counting)
    calc = RootstockCalculator("emt", root=fake_built_root, device="cpu")
    for _ in range(3):
        assert calc.provenance["checkpoint"] == "emt"
    assert calls == ["emt"]


def test_user_weights_are_hashed_for_a_custom_checkpoint(fake_built_root: Path, tmp_path: Path):
    weights = tmp_path / "offset.json"
    weights.write_text('{"offset": 0.25}')
    calc = RootstockCalculator(
        "emt-offset:custom", root=fake_built_root, device="cpu", weights=weights
    )
    provenance = calc.provenance
    assert provenance["checkpoint"] == "emt-offset:custom"
    assert provenance["env"] == "custom-emt"
    assert provenance["weights"] == {
        str(weights.absolute()): hashlib.sha256(weights.read_bytes()).hexdigest()
    }
    # Hashed once: a later change of the file is not re-read by this calculator.
    weights.write_text('{"offset": 0.5}')
    assert calc.provenance["weights"] == provenance["weights"]


def test_evaluate_returns_the_provenance_once_beside_unchanged_results(fake_built_root: Path):
    images = [cu(seed) for seed in range(3)]
    plain = rootstock.evaluate(images, "emt", root=fake_built_root)
    assert type(plain) is list and len(plain) == 3  # the default return is as it was
    both = rootstock.evaluate(images, "emt", root=fake_built_root, provenance=True)
    assert isinstance(both, Evaluation)
    results, provenance = both
    assert len(results) == 3
    for got, want in zip(results, plain, strict=True):
        assert set(got) == set(want)
        np.testing.assert_allclose(got["energy"], want["energy"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-12)
    built = json.loads((fake_built_root / "envs" / "emt" / "rootstock-env.json").read_text())
    assert (provenance["checkpoint"], provenance["build_id"]) == ("emt", built["build_id"])
    assert provenance["device"] == "cpu"  # the local calculator ran the model


def test_evaluate_refuses_a_provenance_that_is_not_a_bool(fake_built_root: Path):
    with pytest.raises(rootstock.RootstockError, match="provenance must be True or False"):
        rootstock.evaluate([cu(0)], "emt", root=fake_built_root, provenance="yes")
