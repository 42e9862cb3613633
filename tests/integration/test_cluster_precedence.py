"""``cluster=`` means what it says, with a real worker (issue #12).

The shared runtime root is registered as ``TEST_CLUSTER`` (``runtime_isolation``).
A decoy install named by ``$ROOTSTOCK_ROOT`` and config.toml must not take over
when a cluster is given, and a mistyped cluster must not quietly run the
universal env instead of that cluster's variant.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator
from rootstock.errors import UsageError

from .conftest import TEST_CLUSTER, build_fake_root

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(120)]

VARIANT_OFFSET = 10.0  # tests/envs/emt_variant.py


@pytest.fixture
def decoy_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An install with no envs, named by both ``$ROOTSTOCK_ROOT`` and config.toml."""
    decoy = build_fake_root(tmp_path / "decoy", {})
    config = tmp_path / "config.toml"
    config.write_text(f'root = "{decoy}"\ncluster = "{TEST_CLUSTER}"\n')
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(config))
    monkeypatch.setenv("ROOTSTOCK_ROOT", str(decoy))
    return decoy


def test_cluster_runs_its_registry_install_not_the_defaults(fake_built_root, decoy_defaults):
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True)
    atoms.rattle(0.02, seed=1)
    reference = atoms.copy()
    reference.calc = EMT()
    with RootstockCalculator(cluster=TEST_CLUSTER, checkpoint="emt", device="cpu") as calc:
        assert calc.spec.layout.root == fake_built_root
        assert calc.spec.env_name == "emt-variant"
        atoms.calc = calc
        energy = atoms.get_potential_energy()
    assert energy == pytest.approx(reference.get_potential_energy() + VARIANT_OFFSET, abs=1e-10)


def test_a_mistyped_cluster_is_refused_not_run_as_the_universal_env(fake_built_root):
    with pytest.raises(UsageError) as info:
        RootstockCalculator(root=fake_built_root, cluster=TEST_CLUSTER + "x", checkpoint="emt")
    assert info.value.message.startswith(f"unknown cluster '{TEST_CLUSTER}x'; known clusters: ")
    assert TEST_CLUSTER in info.value.message
