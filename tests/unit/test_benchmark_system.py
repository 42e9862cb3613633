"""``rootstock benchmark``'s pure parts: ``--system``, the seeded walk, the statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ase.build import bulk

from rootstock.errors import (
    AmbiguousCheckpoint,
    CheckpointNotDeclared,
    CheckpointNotFetched,
    UsageError,
)
from rootstock.ops.benchmark import CheckpointBenchmark, RunTiming
from rootstock.ops.benchmark_probe import WALK_STEP, walk, walk_steps
from rootstock.ops.benchmark_system import parse_setup_kwargs, parse_system, smallest_cubic_repeat

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("per_cell", "at_least", "expected"),
    [(4, 1, 1), (4, 4, 1), (4, 5, 2), (4, 32, 2), (4, 33, 3), (4, 256, 4), (4, 257, 5),
     (2, 16, 2), (8, 64, 2), (1, 1000, 10), (1, 1001, 11), (4, 1_000_000, 63)],
)  # fmt: skip
def test_smallest_cubic_repeat(per_cell, at_least, expected):
    n = smallest_cubic_repeat(per_cell, at_least)
    assert n == expected
    assert per_cell * n**3 >= at_least
    assert n == 1 or per_cell * (n - 1) ** 3 < at_least


@pytest.mark.parametrize(
    ("spec", "natoms", "structure", "repeat"),
    [("Cu:32", 32, "fcc", 2), ("Cu:33", 108, "fcc", 3), ("Cu:256", 256, "fcc", 4),
     ("Cu:1", 4, "fcc", 1), ("Fe:16", 16, "bcc", 2), ("Si:64", 64, "diamond", 2)],
)  # fmt: skip
def test_bulk_is_the_reference_crystal_repeated(spec, natoms, structure, repeat):
    from ase.data import atomic_numbers, reference_states

    system = parse_system(spec)
    element = spec.split(":")[0]
    a = reference_states[atomic_numbers[element]]["a"]
    assert system.natoms == natoms and len(system.atoms) == natoms
    assert system.structure == structure and system.repeat == repeat
    assert system.lattice_constant == a
    assert system.periodic
    assert set(system.atoms.get_chemical_symbols()) == {element}
    assert np.allclose(system.atoms.cell.array, np.eye(3) * a * repeat)
    expected = bulk(element, structure, a=a, cubic=True) * (repeat, repeat, repeat)
    assert np.allclose(system.atoms.positions, expected.positions)
    doc = system.to_dict()
    assert doc == {
        "spec": spec,
        "kind": "bulk",
        "formula": f"{element}{natoms}",
        "natoms": natoms,
        "periodic": True,
        "structure": structure,
        "lattice_constant": a,
        "repeat": repeat,
    }


def test_molecule_is_not_periodic_but_has_a_box():
    system = parse_system("H2O")
    assert system.kind == "molecule" and system.natoms == 3
    assert not system.periodic and not system.atoms.pbc.any()
    assert system.atoms.cell.volume > 0, "a box of vacuum for models that need a cell"
    assert system.to_dict()["structure"] is None and system.to_dict()["repeat"] is None


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("Cu:abc", "not a whole number"),
        ("Cu:", "not a whole number"),
        ("Cu:0", "1 to 1,000,000"),
        ("Cu:-4", "1 to 1,000,000"),
        ("Cu:2000000", "1 to 1,000,000"),
        ("Xx:8", "'Xx' is not a chemical element"),
        ("cu:8", "case-sensitive: Cu"),
        ("Ti:16", "hcp, not cubic"),
        ("He:16", "not cubic"),
        ("not-a-molecule", "not El:N and not an ASE molecule name"),
        ("Cu:8:8", "not a whole number"),
        ("", "empty"),
    ],
)
def test_system_garbage_is_a_usage_error_naming_the_forms(spec, why):
    with pytest.raises(UsageError) as caught:
        parse_system(spec)
    assert caught.value.exit_code == 2
    assert why in caught.value.message
    assert "El:N" in caught.value.hint and "molecule" in caught.value.hint


def test_setup_kwargs_json():
    assert parse_setup_kwargs(None) is None
    assert parse_setup_kwargs('{"task": "omat", "n": 2}') == {"task": "omat", "n": 2}
    for bad in ("{bad", "[1, 2]", '"text"', "3", '{"a": NaN}', '{"a": ' + "[" * 100000):
        with pytest.raises(UsageError) as caught:
            parse_setup_kwargs(bad)
        assert caught.value.exit_code == 2 and "JSON" in caught.value.message


def test_walk_is_seeded_and_moves_every_atom_the_step():
    first = list(walk_steps(7, 5))
    again = list(walk_steps(7, 5))
    other = list(walk_steps(7, 5, seed=43))
    assert len(first) == 5 and all(d.shape == (7, 3) for d in first)
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a, b)
    assert not np.array_equal(first[0], other[0])
    lengths = np.linalg.norm(np.concatenate(first), axis=1)
    assert np.allclose(lengths, WALK_STEP, rtol=1e-12)
    assert len({tuple(d[0]) for d in first}) == 5, "each step goes another way"


def test_walk_moves_atoms_before_every_index_but_the_first():
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True)
    start = atoms.positions.copy()
    seen = []
    for index in walk(atoms, 3):
        seen.append((index, atoms.positions.copy()))
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    assert np.array_equal(seen[0][1], start)
    expected = start
    for delta in walk_steps(len(atoms), 3):
        expected = expected + delta
    assert np.array_equal(seen[-1][1], expected), "the same operations, bit for bit"


def test_statistics_and_overhead():
    calc = RunTiming([0.004, 0.002, 0.003, 0.010, 0.001], 2.5, [1.0, 1.5], [[0.0, 0.1, 0.2]])
    ref = RunTiming(
        [0.001, 0.002, 0.002, 0.002, 0.003], 1.5, [1.0, 1.5 + 1e-9], [[0.0, 0.1, 0.2]], 0.8
    )
    stats = calc.to_dict()
    assert stats["calls"] == 5 and stats["startup_s"] == 2.5 and stats["setup_s"] is None
    assert stats["median_ms"] == pytest.approx(3.0)
    assert stats["min_ms"] == pytest.approx(1.0)
    assert stats["p95_ms"] == pytest.approx(8.8)  # linear between the 4th and 5th
    doc = CheckpointBenchmark("emt", "emt", calc, ref).to_dict()
    assert set(doc) == {
        "checkpoint", "env", "calculator", "in_env", "overhead_ms", "overhead_pct",
        "first_energy", "max_energy_diff", "max_force_diff",
    }  # fmt: skip
    assert doc["overhead_ms"] == pytest.approx(1.0)
    assert doc["overhead_pct"] == pytest.approx(50.0)
    assert doc["in_env"]["setup_s"] == 0.8
    assert doc["max_energy_diff"] == pytest.approx(1e-9, rel=1e-3)
    assert doc["max_force_diff"] == 0.0
    assert math.isclose(doc["first_energy"], 1.0)


def test_id_errors_follow_the_exit_code_rule():
    assert issubclass(CheckpointNotDeclared, UsageError)
    assert CheckpointNotDeclared("x").exit_code == 2
    assert AmbiguousCheckpoint("x").exit_code == 2
    assert CheckpointNotFetched("x").exit_code == 1
