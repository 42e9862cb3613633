"""Which env a RootstockCalculator runs, and what it refuses at construction."""

from __future__ import annotations

import json

import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator
from rootstock.errors import (
    AmbiguousCheckpoint,
    CheckpointNotDeclared,
    EnvFileError,
    RootNotFound,
    UsageError,
)

from .conftest import TEST_CLUSTER, TEST_ENVS, build_fake_root

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(120)]

VARIANT_OFFSET = 10.0  # tests/envs/emt_variant.py


def energy_with(calc) -> tuple[float, float]:
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True)
    atoms.rattle(0.02, seed=1)
    ref = atoms.copy()
    ref.calc = EMT()
    atoms.calc = calc
    return atoms.get_potential_energy(), ref.get_potential_energy()


def test_a_clusters_variant_wins_on_its_cluster(fake_built_root):
    with RootstockCalculator(
        root=fake_built_root, cluster=TEST_CLUSTER, checkpoint="emt", device="cpu"
    ) as calc:
        assert calc.spec.env_name == "emt-variant"
        got, plain = energy_with(calc)
        assert got == pytest.approx(plain + VARIANT_OFFSET, abs=1e-10)


def test_cluster_alone_supplies_the_root_and_picks_the_variant(fake_built_root):
    calc = RootstockCalculator(cluster=TEST_CLUSTER, checkpoint="emt", device="cpu")
    assert calc.spec.layout.root == fake_built_root
    assert calc.spec.env_name == "emt-variant"


def test_without_a_cluster_the_universal_env_runs(fake_built_root):
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        assert calc.spec.env_name == "emt"
        got, plain = energy_with(calc)
        assert got == pytest.approx(plain, abs=1e-10)


def test_an_id_only_variants_declare_asks_for_a_cluster(tmp_path):
    root = build_fake_root(tmp_path / "root", {"emt-variant": TEST_ENVS / "emt_variant.py"})
    with pytest.raises(AmbiguousCheckpoint, match=TEST_CLUSTER):
        RootstockCalculator(root=root, checkpoint="emt")


def test_unknown_checkpoint_fails_at_construction_with_close_matches(fake_built_root):
    with pytest.raises(CheckpointNotDeclared, match=r"close matches: .*charge-emt"):
        RootstockCalculator(root=fake_built_root, checkpoint="charge-emtt")


def test_missing_root_fails_at_construction(tmp_path):
    with pytest.raises(RootNotFound):
        RootstockCalculator(root=tmp_path / "nowhere", checkpoint="emt")


def test_custom_weights_run_through_setup_from_path(fake_built_root, tmp_path):
    weights = tmp_path / "my-weights.json"
    weights.write_text(json.dumps({"offset": 2.5}))
    with RootstockCalculator(
        root=fake_built_root, checkpoint="emt-offset:custom", weights=weights, device="cpu"
    ) as calc:
        got, plain = energy_with(calc)
        assert got == pytest.approx(plain + 2.5, abs=1e-10)
    with RootstockCalculator(root=fake_built_root, checkpoint="emt-offset-0", device="cpu") as calc:
        got, plain = energy_with(calc)
        assert got == pytest.approx(plain, abs=1e-10)


def test_custom_id_without_weights_fails_at_construction(fake_built_root):
    with pytest.raises(UsageError, match="none were given"):
        RootstockCalculator(root=fake_built_root, checkpoint="emt-offset:custom")


def test_weights_without_a_custom_id_fail_at_construction(fake_built_root, tmp_path):
    weights = tmp_path / "w.json"
    weights.write_text("{}")
    with pytest.raises(UsageError, match="only for <family>:custom") as caught:
        RootstockCalculator(root=fake_built_root, checkpoint="emt-offset-0", weights=weights)
    assert "emt-offset:custom" in str(caught.value)


def test_missing_weights_file_fails_at_construction(fake_built_root, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        RootstockCalculator(
            root=fake_built_root, checkpoint="emt-offset:custom", weights=tmp_path / "none"
        )


def test_custom_id_in_an_env_without_setup_from_path_names_the_fix(fake_built_root, tmp_path):
    weights = tmp_path / "w.json"
    weights.write_text("{}")
    with pytest.raises(EnvFileError, match="setup_from_path") as caught:
        RootstockCalculator(root=fake_built_root, checkpoint="nohook:custom", weights=weights)
    assert "maintainer" in caught.value.hint


@pytest.mark.parametrize("key", ["checkpoint", "device", "path"])
def test_setup_kwargs_cannot_override_reserved_arguments(fake_built_root, key):
    with pytest.raises(UsageError, match=key):
        RootstockCalculator(root=fake_built_root, checkpoint="emt", setup_kwargs={key: "x"})


def test_setup_kwargs_must_be_json_serialisable(fake_built_root):
    with pytest.raises(UsageError, match="JSON"):
        RootstockCalculator(root=fake_built_root, checkpoint="emt", setup_kwargs={"f": object()})


def test_construction_starts_no_worker(fake_built_root):
    calc = RootstockCalculator(root=fake_built_root, checkpoint="emt")
    assert calc.worker_pid is None
    calc.close()
