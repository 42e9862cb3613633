"""calculate_batch and rootstock.evaluate through real workers (EMT envs built by uv):
equality with single calls, chunking (counted round trips), bad input, per-index
errors, worker death and timeouts."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest
from ase import Atoms
from ase.build import fcc111, molecule
from ase.calculators.emt import EMT

import rootstock
from rootstock import RootstockCalculator
from rootstock.errors import UsageError, WorkerDiedError, WorkerError, WorkerTimeout
from rootstock.runtime.session import WorkerSession
from tests.integration.structures import cu

# The first test also waits for the session's env builds (real uv), hence 600 s.
pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(600)]

TIGHT = {"rel": 1e-12, "abs": 0}
CLOSE = {"rtol": 1e-12, "atol": 0}


def mixed() -> list[Atoms]:
    """Sizes, species, PBC and info all differ; one non-periodic, one slab."""
    alloy = cu((1, 1, 2), seed=1, a=3.7)
    alloy.numbers[::3] = 47
    alloy.info["charge"] = 1
    alloy.info["label"] = np.int64(7)
    water = molecule("H2O")
    water.center(vacuum=4.0)
    slab = fcc111("Cu", size=(2, 2, 2), vacuum=5.0)
    slab.rattle(0.02, seed=3)
    return [cu(), alloy, water, cu((1, 1, 1), seed=2), slab, cu((2, 2, 1), seed=4)]


@pytest.fixture
def emt(fake_built_root) -> Iterator[RootstockCalculator]:
    with RootstockCalculator(
        root=fake_built_root, checkpoint="emt", device="cpu", shared=False
    ) as calc:
        yield calc


@pytest.fixture
def batches(monkeypatch) -> list[int]:
    """The size of every BATCH sent (one entry per round trip)."""
    sizes: list[int] = []
    original = WorkerSession.compute_batch

    def counted(self, request, **kw):
        sizes.append(len(request.items))
        return original(self, request, **kw)

    monkeypatch.setattr(WorkerSession, "compute_batch", counted)
    return sizes


def single(calc: RootstockCalculator, atoms: Atoms) -> dict:
    atoms = atoms.copy()
    atoms.calc = calc
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if atoms.pbc.all():
        out["stress"] = atoms.get_stress()
    return out


def test_batch_equals_single_calls_in_input_order_and_leaves_results_alone(emt, batches):
    images = mixed()
    first = images[0].copy()
    first.calc = emt
    first.get_potential_energy()
    kept = dict(emt.results)
    pid = emt.worker_pid
    results = emt.calculate_batch(images)
    assert batches == [len(images)]  # one round trip for all six
    assert emt.results.keys() == kept.keys()
    assert all(emt.results[k] is v for k, v in kept.items())
    assert emt.worker_pid == pid
    assert emt.model_dtype == "float64"
    for atoms, result in zip(images, results, strict=True):
        ref = single(emt, atoms)
        assert set(result) == {"energy", "free_energy", "forces"} | (
            {"stress"} if atoms.pbc.all() else set()
        )
        assert result["energy"] == pytest.approx(ref["energy"], **TIGHT)
        assert result["free_energy"] == result["energy"]
        np.testing.assert_allclose(result["forces"], ref["forces"], **CLOSE)
        if "stress" in ref:
            np.testing.assert_allclose(result["stress"], ref["stress"], **CLOSE)
        # And against EMT in this process, which the single calls already match.
        local = atoms.copy()
        local.calc = EMT()
        np.testing.assert_allclose(result["forces"], local.get_forces(), rtol=1e-12, atol=1e-12)
    # Fresh arrays: nothing is shared between results or with the calculator.
    results[0]["forces"][:] = 0.0
    assert results[3]["forces"].any() and emt.results["forces"].any()
    # The worker's single-call system survived the batch: no re-send needed, same answer.
    assert first.get_potential_energy() == kept["energy"]
    first.positions[0, 0] += 0.01
    ref = first.copy()
    ref.calc = EMT()
    assert first.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-10)


def test_generators_are_chunked_by_batch_size_and_atoms(fake_built_root, batches):
    pulled: list[int] = []

    def stream(n: int) -> Iterator[Atoms]:
        for i in range(n):
            pulled.append(i)
            yield cu(seed=i)  # 8 atoms each

    with RootstockCalculator(
        root=fake_built_root, checkpoint="emt", device="cpu", batch_size=4,
        max_atoms_per_chunk=20, shared=False,
    ) as calc:  # fmt: skip
        results = calc.calculate_batch(stream(5), properties=("energy",))
        assert batches == [2, 2, 1]  # 3 x 8 atoms would pass 20
        assert [set(r) for r in results] == [{"energy", "free_energy"}] * 5
        batches.clear()
        results = calc.calculate_batch(stream(9), properties=["forces"], batch_size=3)
        assert batches == [2, 2, 2, 2, 1]
        assert all(set(r) == {"forces"} for r in results)
        batches.clear()
        big = cu((2, 2, 2), seed=9)  # 32 atoms: more than a chunk may hold, so alone
        images = [cu(seed=1), big, cu(seed=2), cu(seed=3), cu(seed=4), cu(seed=5)]
        results = calc.calculate_batch(images, batch_size=3)
        assert batches == [1, 1, 2, 2]
        np.testing.assert_allclose(results[1]["forces"], single(calc, big)["forces"], **CLOSE)
        assert calc.calculate_batch(iter(())) == []


def test_a_generator_is_not_read_ahead_of_what_was_sent(emt, batches):
    pulled: list[int] = []

    def stream() -> Iterator[Atoms]:
        for i in range(4):
            pulled.append(i)
            # When structure i is asked for, every full chunk before it has been answered.
            assert sum(batches) == i - i % 2
            yield cu(seed=i)

    emt.calculate_batch(stream(), properties=("energy",), batch_size=2)
    assert batches == [2, 2] and pulled == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"images": [Atoms("H"), Atoms("H2"), "H2O"]}, r"images\[2\] is builtins\.str"),
        ({"images": (Atoms("H"), None)}, r"images\[1\] is builtins\.NoneType"),
        ({"images": Atoms("H2")}, "not one ase.Atoms"),
        ({"images": 5}, "iterable of ase.Atoms"),
        ({"properties": ("energy", "spin")}, "unknown property 'spin'.*"),
        ({"properties": ()}, "at least one property"),
        ({"errors": "ignore"}, "errors must be 'raise' or 'return'"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"batch_size": -3}, "batch_size must be a positive integer"),
        ({"batch_size": 2.0}, "batch_size must be a positive integer"),
        ({"batch_size": True}, "batch_size must be a positive integer"),
    ],
)
def test_bad_input_is_a_usage_error_before_anything_is_sent(emt, batches, kwargs, match):
    args = {"images": [Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.74]])], **kwargs}
    with pytest.raises(UsageError, match=match) as info:
        emt.calculate_batch(**args)
    if kwargs.get("properties"):
        assert "known properties: energy, free_energy, forces, stress" in str(info.value)
    assert batches == [] and emt.worker_pid is None


def test_an_empty_iterable_starts_no_worker(emt):
    assert emt.calculate_batch([]) == []
    assert emt.calculate_batch(a for a in ()) == []
    assert emt.worker_pid is None


def bad_and_good() -> list[Atoms]:
    uranium = cu(seed=5)
    uranium.numbers[3] = 92  # EMT has no potential for U
    nan = cu(seed=6)
    nan.positions[2, 1] = np.nan
    return [cu(seed=1), uranium, cu(seed=2), nan, Atoms(), cu(seed=3)]


def test_per_index_errors_are_returned_in_their_slots_and_the_worker_lives(emt, batches):
    results = emt.calculate_batch(bad_and_good(), errors="return", batch_size=4)
    pid = emt.worker_pid
    assert batches == [3, 1]  # NaN and empty structures were never sent
    errors = {i: r for i, r in enumerate(results) if isinstance(r, Exception)}
    assert sorted(errors) == [1, 3, 4]
    assert all(isinstance(e, WorkerError) for e in errors.values())
    assert str(errors[1]).startswith("structure 1: 'emt' (env emt) failed in the calculation")
    assert "No EMT-potential for U" in str(errors[1])
    assert "Traceback" in errors[1].remote_traceback
    assert "structure 3 has NaN or inf" in str(errors[3])
    assert "structure 4 has no atoms" in str(errors[4])
    for i in (0, 2, 5):
        assert results[i]["energy"] == pytest.approx(single(emt, bad_and_good()[i])["energy"])
    assert emt.worker_pid == pid


def test_errors_raise_names_the_index_and_the_worker_lives(emt, batches):
    images = bad_and_good()
    with pytest.raises(WorkerError, match=r"structure 1: .*No EMT-potential for U") as info:
        emt.calculate_batch(images, batch_size=4)
    assert not isinstance(info.value, WorkerDiedError)
    assert batches == [3]  # the error was raised once its chunk was read, nothing more sent
    pid = emt.worker_pid
    assert pid is not None
    assert len(emt.calculate_batch(images[:1] + images[2:3])) == 2
    assert emt.worker_pid == pid
    with pytest.raises(WorkerError, match="structure 3 has NaN"):
        emt.calculate_batch([images[0]] * 3 + [images[3]], batch_size=4)
    assert emt.worker_pid == pid


def test_extras_and_info_travel(fake_built_root):
    images = mixed()[:4]
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        results = calc.calculate_batch(images, properties=("energy", "energies", "magmoms"))
        for atoms, result in zip(images, results, strict=True):
            local = atoms.copy()
            local.calc = EMT()
            # EMT fills energies and never magmoms: an extra not filled is left out.
            assert set(result) == {"energy", "free_energy", "energies"}
            np.testing.assert_allclose(
                result["energies"], local.get_potential_energies(), rtol=0, atol=1e-12
            )
    charged = []
    for charge in (0, 1, 2):
        atoms = cu(seed=3)
        atoms.info["charge"] = charge
        charged.append(atoms)
    with RootstockCalculator(root=fake_built_root, checkpoint="charge-emt", device="cpu") as calc:
        energies = [r["energy"] for r in calc.calculate_batch(charged, properties=["energy"])]
    assert np.diff(energies) == pytest.approx([0.75, 0.75], abs=1e-12)


def test_a_worker_death_mid_list_carries_the_finished_results(emt, batches):
    def stream() -> Iterator[Atoms]:
        for i in range(7):
            if i == 4:
                os.kill(emt.worker_pid, signal.SIGKILL)
            yield cu(seed=i)

    with pytest.raises(WorkerDiedError, match="SIGKILL") as info:
        emt.calculate_batch(stream(), batch_size=2)
    partial = info.value.partial_results
    assert isinstance(partial, list) and len(partial) == 4
    for i, result in enumerate(partial):
        assert result["energy"] == pytest.approx(single(emt, cu(seed=i))["energy"], **TIGHT)
    assert emt.worker_pid is not None  # the single calls above started a fresh worker


def test_the_timeout_applies_per_chunk(fake_built_root):
    slow = []
    for i in range(4):
        atoms = cu(seed=i)
        atoms.info["sleep"] = 0.8
        slow.append(atoms)
    with RootstockCalculator(
        root=fake_built_root, checkpoint="charge-emt", device="cpu", shared=False
    ) as calc:
        calc.calculate_batch(slow[:1], properties=["energy"])  # start-up is not timed here
        pid = calc.worker_pid
        calc.timeout = 2.0
        # Four structures take 3.2 s in all, but each chunk of two only 1.6 s.
        assert len(calc.calculate_batch(slow, properties=["energy"], batch_size=2)) == 4
        assert calc.worker_pid == pid
        with pytest.raises(WorkerTimeout, match="did not answer within 2 s"):
            calc.calculate_batch(slow, properties=["energy"], batch_size=3)
        assert calc.worker_pid is None  # stopped, as a single call's timeout does


def test_rootstock_evaluate(fake_built_root, batches):
    images = mixed()[:3]
    results = rootstock.evaluate(
        images, checkpoint="emt", root=fake_built_root, batch_size=2, properties=["energy"]
    )
    assert batches == [2, 1]
    assert [set(r) for r in results] == [{"energy", "free_energy"}] * 3
    for atoms, result in zip(images, results, strict=True):
        local = atoms.copy()
        local.calc = EMT()
        assert result["energy"] == pytest.approx(local.get_potential_energy(), abs=1e-10)
    uranium = cu()
    uranium.numbers[0] = 92
    out = rootstock.evaluate([uranium], checkpoint="emt", root=fake_built_root, errors="return")
    assert isinstance(out[0], WorkerError)
    with pytest.raises(UsageError, match=r"cannot use executor=builtins.str") as refused:
        rootstock.evaluate(images, checkpoint="emt", root=fake_built_root, executor="dask")
    assert "Parsl Config" in str(refused.value) and "distributed.Client" in str(refused.value)
    with pytest.raises(UsageError, match=r"unknown keyword.*colour"):
        rootstock.evaluate(images, checkpoint="emt", root=fake_built_root, colour="red")
    assert "evaluate" in rootstock.__all__


def test_a_structure_too_large_for_a_batch_frame_goes_as_a_single_call(emt, batches, monkeypatch):
    from rootstock.runtime import batch

    monkeypatch.setattr(batch, "WIRE_ATOMS_PER_CHUNK", 10)  # stands in for ~500,000 atoms
    big = cu((2, 2, 2), seed=7)  # 32 atoms
    uranium = big.copy()
    uranium.numbers[0] = 92
    images = [cu(seed=1), big, uranium, cu(seed=2)]
    results = emt.calculate_batch(
        images, properties=("energy", "forces", "stress", "energies"), errors="return"
    )
    assert batches == [1, 1]  # the two 32-atom structures went as single calls
    ref = single(emt, big)
    assert results[1]["energy"] == pytest.approx(ref["energy"], **TIGHT)
    np.testing.assert_allclose(results[1]["forces"], ref["forces"], **CLOSE)
    np.testing.assert_allclose(results[1]["stress"], ref["stress"], **CLOSE)
    assert results[1]["energies"].shape == (32,)
    assert isinstance(results[2], WorkerError)
    assert str(results[2]).startswith("structure 2: 'emt' (env emt) failed in the calculation")


def test_an_env_vendored_before_batching_gets_a_rebuild_hint(own_root):
    # An older worker: its protocol module does not know the BATCH word. The file is
    # replaced, never written through (uv hard-links files from its cache).
    vendored = next((own_root / "envs" / "emt").resolve().glob("lib/python*/site-packages"))
    protocol = vendored / "rootstock" / "wire" / "framing.py"
    text = protocol.read_text()
    assert "        BATCH, BATCHREADY,\n" in text
    older = protocol.with_name("framing.py.older")
    older.write_text(text.replace("        BATCH, BATCHREADY,\n", ""))
    os.replace(older, protocol)
    for cached in protocol.parent.glob("__pycache__/framing.*"):
        cached.unlink()
    with RootstockCalculator(root=own_root, checkpoint="emt", device="cpu", shared=False) as calc:
        with pytest.raises(WorkerError, match="older rootstock") as caught:
            calc.calculate_batch([cu()])
        assert not isinstance(caught.value, WorkerDiedError)
        assert "rootstock install emt --force" in str(caught.value)
        atoms = cu()
        atoms.calc = calc
        # Single calls still work with that worker (a fresh one: the old one exited).
        reference = cu()
        reference.calc = EMT()
        assert atoms.get_potential_energy() == pytest.approx(
            reference.get_potential_energy(), **TIGHT
        )


def test_the_envs_hook_gets_whole_chunks_and_a_failing_chunk_is_rerun_one_at_a_time(
    fake_built_root, tmp_path
):
    record = tmp_path / "hook-calls.jsonl"
    images = [cu(seed=seed) for seed in range(10)]
    with RootstockCalculator(
        root=fake_built_root,
        checkpoint="batch-emt",
        device="cpu",
        setup_kwargs={"record": str(record)},
        shared=False,
    ) as calc:
        results = calc.calculate_batch(images, batch_size=4)
        calls = [json.loads(line) for line in record.read_text().splitlines()]
        assert [call["size"] for call in calls] == [4, 4, 2]
        assert all(call["properties"] == ["energy", "forces", "stress"] for call in calls)
        for atoms, result in zip(images, results, strict=True):
            reference = atoms.copy()
            reference.calc = EMT()
            assert result["energy"] == pytest.approx(reference.get_potential_energy(), **TIGHT)
            np.testing.assert_allclose(result["forces"], reference.get_forces(), **CLOSE)
            np.testing.assert_allclose(result["stress"], reference.get_stress(), **CLOSE)
        pid = calc.worker_pid
        record.unlink()
        uranium = cu(seed=20)
        uranium.numbers[0] = 92
        # A fixed count: one hook call per chunk (auto would probe with smaller calls).
        out = calc.calculate_batch(
            [cu(seed=21), uranium, cu(seed=22)], errors="return", batch_size=4
        )
        # The hook failed the chunk as a whole; re-run one structure at a time, it named it.
        sizes = [json.loads(line)["size"] for line in record.read_text().splitlines()]
        assert sizes == [3, 1, 1, 1]
        assert isinstance(out[0], dict) and isinstance(out[2], dict)
        assert isinstance(out[1], WorkerError)
        assert str(out[1]).startswith("structure 1: 'batch-emt'")
        assert calc.worker_pid == pid
