"""A committee's numbers (runtime/committee_stats.py) and its watch, without workers."""

from __future__ import annotations

import ase.io  # noqa: F401 (loaded at collection: registering its plugins starts a process)
import numpy as np
import pytest

from rootstock.errors import UsageError
from rootstock.runtime.committee_stats import combine
from rootstock.runtime.committee_watch import UncertaintyExceeded, watch

RNG = np.random.default_rng(7)


def member(energy: float, forces: np.ndarray, stress: np.ndarray | None = None) -> dict:
    out = {"energy": energy, "free_energy": energy, "forces": forces}
    if stress is not None:
        out["stress"] = stress
    return out


def test_three_members_give_population_spreads_and_the_max_force_deviation():
    forces = [RNG.normal(size=(5, 3)).astype(np.float32) for _ in range(3)]
    stress = [RNG.normal(size=6) for _ in range(3)]
    members = {f"m{i}": member(float(i), forces[i], stress[i]) for i in range(3)}
    out = combine(members, baseline={"m0": 0.0, "m1": 1.0, "m2": 1.5})
    stacked = np.array(forces, dtype=np.float64)
    assert out["energy"] == pytest.approx(1.0)
    assert out["energy_std"] == pytest.approx(np.sqrt(2 / 3))  # ddof=0, not 1
    assert out["energy_std_relative"] == pytest.approx(np.std([0.0, 0.0, 0.5]))
    np.testing.assert_allclose(out["forces"], stacked.mean(axis=0))
    np.testing.assert_allclose(out["forces_std"], stacked.std(axis=0, ddof=0))
    deviations = np.linalg.norm(stacked - stacked.mean(axis=0), axis=2) ** 2  # (m, i)
    assert out["max_force_dev"] == pytest.approx(np.sqrt(deviations.mean(axis=0)).max())
    np.testing.assert_allclose(out["stress_std"], np.std(stress, axis=0))
    assert out["forces"].dtype == np.float64 and out["members"]["m1"]["forces"].dtype == np.float64
    assert set(out["members"]["m2"]) == {"energy", "forces", "stress"}
    assert out["dropped"] == []


def test_a_reference_member_gives_its_values_and_the_same_spreads():
    f = RNG.normal(size=(4, 3))
    members = {"a": member(-3.0, f), "b": member(-1.0, 1.01 * f)}
    mean = combine(members)
    ref = combine(members, reference="b", dropped=["c"])
    assert ref["energy"] == -1.0 and mean["energy"] == -2.0
    np.testing.assert_array_equal(ref["forces"], 1.01 * f)
    assert ref["energy_std"] == mean["energy_std"] == 1.0
    np.testing.assert_allclose(ref["forces_std"], 0.005 * np.abs(f), rtol=1e-12)
    assert ref["max_force_dev"] == pytest.approx(0.005 * np.linalg.norm(f, axis=1).max())
    assert "energy_std_relative" not in ref  # no baseline given
    assert ref["dropped"] == ["c"]


def test_stress_is_combined_only_when_every_member_has_it():
    f = np.zeros((2, 3))
    out = combine({"a": member(0.0, f, np.ones(6)), "b": member(0.0, f)})
    assert "stress" not in out and "stress_std" not in out
    assert out["max_force_dev"] == 0.0


class FakeCommittee:
    """What watch() reads: results, atoms and members."""

    def __init__(self, dev: float) -> None:
        from ase.build import bulk

        self.atoms = bulk("Cu", cubic=True)
        self.members = {"a": None, "b": None}
        self.results = {
            "energy": -1.0,
            "forces": np.zeros((4, 3)),
            "max_force_dev": dev,
            "energy_std": 0.3,
            "energy_std_relative": 0.01,
        }


class Frames:
    def __init__(self) -> None:
        self.written: list = []

    def write(self, atoms) -> None:
        self.written.append(atoms)


def test_watch_raises_past_a_threshold_and_writes_instead_with_a_trajectory():
    calm = FakeCommittee(0.1)
    watch(calm, max_force_dev=0.2)()  # below: nothing
    hot = FakeCommittee(0.25)
    with pytest.raises(UncertaintyExceeded, match=r"max_force_dev 0\.25") as caught:
        watch(hot, max_force_dev=0.2)()
    assert caught.value.exceeded == ("max_force_dev",)
    assert caught.value.spreads["energy_std"] == 0.3
    assert caught.value.atoms.get_potential_energy() == -1.0
    assert caught.value.atoms is not hot.atoms
    with pytest.raises(UncertaintyExceeded, match="energy_std_relative"):
        watch(calm, max_force_dev=None, energy_std_relative=0.005)()
    frames = Frames()
    keeper = watch(hot, max_force_dev=0.2, energy_std=0.5, trajectory=frames)
    keeper()
    keeper()
    assert keeper.frames == len(frames.written) == 2
    assert frames.written[0].info["committee"]["max_force_dev"] == 0.25


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_force_dev": None},
        {"max_force_dev": -1.0},
        {"max_force_dev": "0.2"},
        {"trajectory": 3},
    ],
)
def test_bad_watch_arguments_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        watch(FakeCommittee(0.1), **kwargs)
