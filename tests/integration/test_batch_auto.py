"""``batch_size="auto"`` through real workers (the memory-emt test env, built by uv):
sub-batches stay within the memory budget, a model that runs out of memory has its
sub-batch halved and every result delivered, and the bound it taught is kept.

Each test reads the worker's memory report (``calc.memory_report``, the BATCHREADY
``memory`` field) and the env's own record of the hook calls it got; every result
is compared with ASE's EMT in this process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.calculators.emt import EMT

import rootstock
from rootstock import RootstockCalculator
from rootstock.errors import UsageError, WorkerError
from tests.integration.structures import cu
from tests.unit.test_chunk_sizer import within_budget

# The first test of a module may wait for the session's env builds (real uv).
pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(900)]

MIB = 1 << 20
# Each atom of a hook call holds this much: an 8-atom cell costs 2 MiB.
BYTES_PER_ATOM = 256 << 10
# Three 8-atom cells (6 MiB, and what EMT itself takes) fit in the nine tenths of it
# the worker plans to; a fourth would not.
BUDGET = 8 * MIB


def cells(count: int, repeat: tuple[int, int, int] = (2, 1, 1)) -> list[Atoms]:
    return [cu(repeat, seed=seed) for seed in range(count)]


def assert_emt(images: list[Atoms], results: list) -> None:
    """Every result equals ASE's EMT in this process."""
    for atoms, result in zip(images, results, strict=True):
        own = atoms.copy()
        own.calc = EMT()
        assert result["energy"] == pytest.approx(own.get_potential_energy(), rel=1e-12, abs=0)
        np.testing.assert_allclose(result["forces"], own.get_forces(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(result["stress"], own.get_stress(), rtol=1e-10, atol=1e-14)


def hook_calls(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.fixture
def record(tmp_path: Path) -> Path:
    return tmp_path / "hook-calls.jsonl"


@pytest.fixture
def growing(fake_built_root: Path, record: Path) -> Iterator[RootstockCalculator]:
    """Hook calls that hold BYTES_PER_ATOM per atom, under a budget of BUDGET."""
    with RootstockCalculator(
        "memory-emt", root=fake_built_root, device="cpu", shared=False,
        setup_kwargs={"record": str(record), "bytes_per_atom": BYTES_PER_ATOM},
        max_memory=BUDGET,
    ) as calc:  # fmt: skip
        yield calc


def test_auto_sub_batches_stay_within_the_budget(growing, record):
    # A single call first, so the worker's one-off costs (EMT's first neighbour
    # list, lazy imports) are paid before the probe measures anything.
    warm = cu()
    warm.calc = growing
    warm.get_potential_energy()
    images = cells(16)  # 32 MiB if the hook got them in one call
    results = growing.calculate_batch(images)
    assert_emt(images, results)
    report = growing.memory_report
    assert report is not None and report["meter"] == "rss"
    assert report["budget"] == BUDGET
    runs = report["batches"]
    # The worker ran the one chunk in several sub-batches, each under its budget,
    # and the measurement is real: a single 8-atom structure's 2 MiB shows.
    assert len(runs) > 1 and sum(r["structures"] for r in runs) == len(images)
    assert all(within_budget(r, BUDGET) for r in runs), runs
    assert max(r["peak"] or 0 for r in runs) >= 8 * BYTES_PER_ATOM
    # The probe came first (1, then 2 structures); the fit then filled the budget.
    assert [r["structures"] for r in runs[:2]] == [1, 2]
    assert max(r["structures"] for r in runs) == 3
    # The fit found the cost per atom (the peaks also hold EMT's own and the heap's
    # noise, which the fitted base absorbs).
    assert 0.5 * BYTES_PER_ATOM <= report["per_atom"] <= 1.5 * BYTES_PER_ATOM
    assert [(c["structures"], c["atoms"]) for c in hook_calls(record)] == [
        (r["structures"], r["atoms"]) for r in runs
    ]


def test_the_fit_is_kept_for_the_next_batch(growing):
    growing.calculate_batch(cells(8))
    growing.calculate_batch(cells(12))
    runs = growing.memory_report["batches"]
    # No second probe: every sub-batch is planned from the kept fit, and fills it.
    assert len(runs) > 1 and runs[0]["structures"] > 1
    assert all(within_budget(r, BUDGET) and r["predicted"] <= 0.9 * BUDGET for r in runs), runs


def test_a_fixed_count_sends_no_memory_bound(growing, record):
    images = cells(6)
    results = growing.calculate_batch(images, batch_size=6)
    assert_emt(images, results)
    assert growing.memory_report is None
    assert [c["structures"] for c in hook_calls(record)] == [6]  # one call, as before


def test_out_of_memory_halves_delivers_everything_and_keeps_the_bound(fake_built_root, record):
    with RootstockCalculator(
        "memory-emt", root=fake_built_root, device="cpu", shared=False,
        setup_kwargs={"record": str(record), "oom_atoms": 20},
    ) as calc:  # fmt: skip
        images = cells(12)  # 8 atoms each: at most two fit in one call
        results = calc.calculate_batch(images)
        assert_emt(images, results)
        first = calc.memory_report
        assert first["halvings"] >= 1 and first["max_atoms"] <= 20
        failed = [r for r in first["batches"] if r["out_of_memory"]]
        assert failed and all(r["atoms"] > 20 for r in failed)
        assert sum(r["structures"] for r in first["batches"] if not r["out_of_memory"]) == 12

        # The next chunk is cut to the bound at once: nothing runs out of memory.
        calls_before = len(hook_calls(record))
        again = cells(10)
        assert_emt(again, calc.calculate_batch(again))
        second = calc.memory_report
        assert second["halvings"] == 0
        assert all(r["atoms"] <= 20 for r in second["batches"]), second
        assert all(c["atoms"] <= 20 for c in hook_calls(record)[calls_before:])

        # A structure too large even alone fails alone, with the model's MemoryError.
        mixed = [cu((2, 1, 1)), cu((3, 1, 1)), cu((2, 1, 1), seed=5)]  # 8, 12, 8 atoms
        mixed.insert(1, cu((3, 2, 1)))  # 24 atoms
        outcomes = calc.calculate_batch(mixed, errors="return")
        assert isinstance(outcomes[1], WorkerError) and "MemoryError" in str(outcomes[1])
        assert "structure 1" in str(outcomes[1])
        kept = [mixed[i] for i in (0, 2, 3)]
        assert_emt(kept, [outcomes[i] for i in (0, 2, 3)])


def test_evaluate_takes_auto_and_max_memory(fake_built_root):
    images = cells(5)
    results = rootstock.evaluate(
        images, "memory-emt", root=fake_built_root, max_memory="1GiB",
        setup_kwargs={"bytes_per_atom": 4096},
    )  # fmt: skip
    assert_emt(images, results)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_memory": "lots"},
        {"max_memory": 0},
        {"max_memory": -0.5},
        {"max_memory": 1.5},
        {"max_memory": 512},  # an integer is bytes: surely a fraction was meant
        {"max_memory": "150%"},
        {"max_memory": True},
        {"batch_size": "big"},
        {"batch_size": 0},
        {"batch_size": 8, "max_memory": 0.5},
    ],
)
def test_bad_bounds_are_usage_errors(fake_built_root, kwargs):
    with pytest.raises(UsageError) as caught:
        RootstockCalculator("memory-emt", root=fake_built_root, device="cpu", **kwargs)
    assert caught.value.hint
    with pytest.raises(UsageError):
        rootstock.evaluate(cells(1), "memory-emt", root=fake_built_root, **kwargs)


def test_bad_bounds_per_call_are_usage_errors(growing):
    for kwargs in ({"max_memory": "-1GB"}, {"batch_size": 4, "max_memory": "1GB"}):
        with pytest.raises(UsageError, match="max_memory"):
            growing.calculate_batch(cells(1), **kwargs)
    assert growing.worker_pid is None  # refused before anything was sent
