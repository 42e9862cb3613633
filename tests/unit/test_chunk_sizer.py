"""The worker's memory-bounded sub-batches (rootstock.worker.memory), in this process.

The fit and the plan are pure functions; the sizer runs real model stand-ins:
functions that hold real memory (numpy buffers, written, so this process's peak
RSS grows) or raise MemoryError above a number of atoms, as a model would. The
last tests drive the worker's whole BATCH path (run_batch) with ASE's EMT.
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock.errors import ProtocolError, UsageError
from rootstock.runtime.batch import checked_batch_size, checked_max_memory
from rootstock.wire.batch import (
    BatchItem,
    BatchReply,
    BatchRequest,
    ItemError,
    ItemResult,
    MemoryLimit,
    decode_batch_body,
    decode_batchready_body,
    encode_batch,
    encode_batchready,
)
from rootstock.worker.batch import run_batch
from rootstock.worker.memory import (
    SETTLED_SHARE,
    ChunkSizer,
    LinearBound,
    RssMeter,
    fit_bound,
    fitting_count,
    is_out_of_memory,
)
from rootstock.worker.model import ModelRunner

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def structures(*sizes: int) -> list[Atoms]:
    """Hydrogen chains of these sizes, each tagged with its index."""
    out = []
    for index, n in enumerate(sizes):
        atoms = Atoms("H" * n, positions=[(0.0, 0.0, 1.0 * i) for i in range(n)])
        atoms.info["index"] = index
        out.append(atoms)
    return out


def tags(sub: list[Atoms]) -> list[int]:
    return [atoms.info["index"] for atoms in sub]


class FailsAbove:
    """A model that raises MemoryError for a call of more than ``limit`` atoms."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[int] = []

    def __call__(self, sub: list[Atoms]) -> list[int]:
        atoms = sum(len(a) for a in sub)
        self.calls.append(atoms)
        if atoms > self.limit:
            raise MemoryError(f"{atoms} atoms")
        return tags(sub)


# --- the fit and the plan --------------------------------------------------------------


def test_points_on_a_line_give_that_line():
    bound = fit_bound([(8, 1000 + 8 * 50), (16, 1000 + 16 * 50), (32, 1000 + 32 * 50)])
    assert bound == LinearBound(pytest.approx(1000), pytest.approx(50))


def test_the_fit_bounds_every_point_from_above():
    points = [(8, 1500), (16, 1700), (24, 2600), (32, 2700)]
    bound = fit_bound(points)
    assert bound is not None and bound.per_atom > 0
    assert all(bound.predict(a) >= p for a, p in points)
    assert any(bound.predict(a) == pytest.approx(p) for a, p in points)  # and touches one


def test_a_falling_measurement_is_no_negative_slope():
    bound = fit_bound([(8, 5000), (16, 3000)])
    assert bound == LinearBound(5000, 0.0)


def test_one_size_is_taken_as_all_per_atom():
    assert fit_bound([(8, 800), (8, 1600)]) == LinearBound(0.0, 200.0)
    assert fit_bound([]) is None


def test_a_plan_fills_the_budget_and_the_atom_cap():
    bound = LinearBound(100, 10)
    assert fitting_count([5, 5, 5, 5], bound, 250, None) == 3  # 100 + 150 fits, 200 not
    assert fitting_count([5, 5, 5, 5], bound, 250, 9) == 1
    assert fitting_count([5, 5, 5, 5], None, None, None) == 4
    assert fitting_count([50, 5], bound, 250, 9) == 1  # too large alone: it still goes


# --- the sizer -------------------------------------------------------------------------


def test_out_of_memory_halves_keeps_order_and_the_bound():
    model = FailsAbove(20)
    sizer = ChunkSizer("cpu")
    batch = structures(*[8] * 12)
    assert sizer.run(batch, model) == list(range(12))
    first = sizer.take_report()
    assert first["halvings"] >= 1 and first["max_atoms"] <= 20
    assert sum(r["structures"] for r in first["batches"] if not r["out_of_memory"]) == 12
    # The next batch is cut to the bound at once.
    model.calls.clear()
    assert sizer.run(structures(*[8] * 9), model) == list(range(9))
    assert max(model.calls) <= 20
    assert sizer.take_report()["halvings"] == 0


def test_a_structure_too_large_alone_gets_its_error():
    sizer = ChunkSizer("cpu")
    entries = sizer.run(structures(4, 30, 4, 4), FailsAbove(20))
    assert [entries[i] for i in (0, 2, 3)] == [0, 2, 3]
    assert isinstance(entries[1], MemoryError) and "30 atoms" in str(entries[1])


def test_sub_batches_stay_within_a_budget_of_real_memory():
    per_atom = 256 << 10  # 2 MiB per 8-atom structure
    budget = 8 * MIB  # planned to nine tenths: three structures a call

    def holding(sub: list[Atoms]) -> list[int]:
        held = np.ones(per_atom * sum(len(a) for a in sub) // 8)
        assert held.sum() > 0
        return tags(sub)

    sizer = ChunkSizer("cpu")
    if not isinstance(sizer.meter, RssMeter) or sizer.meter.name != "rss":
        pytest.fail("this Linux should let a process reset its peak RSS (clear_refs)")
    holding(structures(8))  # numpy's one-off costs, before anything is measured
    batch = structures(*[8] * 16)  # 32 MiB in one call
    assert sizer.run(batch, holding, MemoryLimit(nbytes=budget)) == list(range(16))
    report = sizer.take_report()
    runs = report["batches"]
    assert report["budget"] == budget and len(runs) > 3
    # A call is measured, and within the budget, unless the settled bound put it under
    # half the budget (SETTLED_SHARE); then it runs unmeasured.
    assert all(within_budget(r, budget) for r in runs), runs
    assert max(r["peak"] or 0 for r in runs) >= 8 * per_atom  # the measurement sees the buffers
    # glibc's heap adds noise to a peak (the fitted base absorbs it), not to its slope.
    assert 0.5 * per_atom <= report["per_atom"] <= 1.5 * per_atom


def test_other_failures_are_the_callers():
    def broken(sub: list[Atoms]) -> list[int]:
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError, match="not a memory problem"):
        ChunkSizer("cpu").run(structures(4, 4), broken)
    with pytest.raises(ValueError, match="one entry per structure"):
        ChunkSizer("cpu").run(structures(4, 4), lambda sub: [])


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (MemoryError(), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (type("OutOfMemoryError", (RuntimeError,), {})("CUDA error"), True),
        (RuntimeError("shape mismatch"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_what_counts_as_out_of_memory(exc, expected):
    assert is_out_of_memory(exc) is expected


def test_the_default_budget_is_a_share_of_the_available_ram():
    meter = RssMeter()
    default = meter.budget(MemoryLimit())
    whole = meter.budget(MemoryLimit(fraction=1.0))
    assert default is not None and whole is not None and 0 < default < whole
    assert meter.budget(MemoryLimit(nbytes=123 * MIB)) == 123 * MIB


# --- the worker's BATCH path -----------------------------------------------------------


def emt_hook(limit: int):
    def evaluate_batch(calc, atoms_list, properties):
        atoms = sum(len(a) for a in atoms_list)
        if atoms > limit:
            raise MemoryError(f"{atoms} atoms in one call")
        out = []
        for a in atoms_list:
            own = a.copy()
            own.calc = EMT()
            out.append({"energy": own.get_potential_energy(), "forces": own.get_forces()})
        return out

    return evaluate_batch


def cu_items(count: int) -> list[BatchItem]:
    items = []
    for seed in range(count):
        atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 1, 1)
        atoms.rattle(0.05, seed=seed)
        items.append(BatchItem(atoms.numbers, atoms.pbc, atoms.cell.array, atoms.positions))
    return items


def reply_to(runner: ModelRunner, hook, request: BatchRequest) -> BatchReply:
    frame = run_batch(runner, hook, request)
    assert frame.startswith(b"BATCHREADY")
    return decode_batchready_body(frame[16:], [item.natoms for item in request.items])


def test_a_sized_batch_delivers_every_structure_through_the_hook():
    items = cu_items(10)
    runner = ModelRunner(EMT())
    reply = reply_to(runner, emt_hook(20), BatchRequest(items, ("energy",), memory=MemoryLimit()))
    for item, result in zip(items, reply.results, strict=True):
        own = Atoms(numbers=item.numbers, pbc=item.pbc, cell=item.cell, positions=item.positions)
        own.calc = EMT()
        assert isinstance(result, ItemResult)
        assert result.energy == pytest.approx(own.get_potential_energy(), rel=1e-12, abs=0)
    assert reply.memory is not None and reply.memory["halvings"] >= 1
    assert runner.chunk_sizer.max_atoms is not None and runner.chunk_sizer.max_atoms <= 20


def test_without_a_bound_the_batch_is_one_call_as_before():
    items = cu_items(3)  # 24 atoms: one call fails, so each is rerun alone and succeeds
    reply = reply_to(ModelRunner(EMT()), emt_hook(20), BatchRequest(items, ("energy",)))
    assert all(isinstance(r, ItemResult) for r in reply.results)
    assert reply.memory is None
    one_too_many = reply_to(ModelRunner(EMT()), emt_hook(4), BatchRequest(items, ("energy",)))
    assert all(isinstance(r, ItemError) and r.type == "MemoryError" for r in one_too_many.results)


# --- the wire and the client's arguments ------------------------------------------------


@pytest.mark.parametrize(
    "memory", [MemoryLimit(), MemoryLimit(fraction=0.25), MemoryLimit(nbytes=4 << 30)]
)
def test_the_memory_field_travels(memory):
    frame = encode_batch(BatchRequest(cu_items(2), ("energy",), memory=memory))
    assert decode_batch_body(frame[16:]).memory == memory
    plain = encode_batch(BatchRequest(cu_items(2), ("energy",)))
    assert b"memory" not in plain and decode_batch_body(plain[16:]).memory is None


def test_a_memory_report_travels():
    report = {"meter": "rss", "budget": 5, "batches": [{"structures": 1, "peak": 3}]}
    frame = encode_batchready(BatchReply([ItemResult(energy=1.0)], None, report), [8])
    assert decode_batchready_body(frame[16:], [8]).memory == report


def _with_json(frame: bytes, old: bytes, new: bytes) -> bytes:
    """``frame``'s body with its JSON part edited (kept a multiple of 8 by padding)."""
    body = frame[16:]
    count, length = np.frombuffer(body[:8], dtype=np.int32)
    doc = body[8 : 8 + length].rstrip().replace(old, new)
    doc += b" " * (-len(doc) % 8)
    head = np.array([count, len(doc)], dtype=np.int32).tobytes()
    return head + doc + body[8 + length :]


@pytest.mark.parametrize(
    "field",
    [b'"memory":3', b'"memory":{"fraction":0}', b'"memory":{"fraction":1.5}',
     b'"memory":{"bytes":-1}', b'"memory":{"bytes":1,"fraction":0.5}',
     b'"memory":{"fraction":true}'],
)  # fmt: skip
def test_a_malformed_memory_field_is_a_protocol_error(field):
    frame = encode_batch(BatchRequest(cu_items(1), ("energy",)))
    with pytest.raises(ProtocolError, match="memory"):
        decode_batch_body(_with_json(frame, b'"properties"', field + b',"properties"'))


def test_unknown_fields_are_ignored_by_the_reader():
    # How a worker built before memory sizing takes a BATCH that carries "memory".
    frame = encode_batch(BatchRequest(cu_items(1), ("energy",)))
    body = _with_json(frame, b'"properties"', b'"later":{"x":1},"properties"')
    assert decode_batch_body(body).memory is None
    body = _with_json(frame, b'"properties"', b'"memory":{"later":1},"properties"')
    assert decode_batch_body(body).memory == MemoryLimit()


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        (None, MemoryLimit()),
        (0.25, MemoryLimit(fraction=0.25)),
        (1, None),
        (4 << 30, MemoryLimit(nbytes=4 << 30)),
        (np.int64(2 << 30), MemoryLimit(nbytes=2 << 30)),
        (3e9, MemoryLimit(nbytes=3_000_000_000)),
        ("4GB", MemoryLimit(nbytes=4_000_000_000)),
        ("512 MiB", MemoryLimit(nbytes=512 << 20)),
        ("1.5gib", MemoryLimit(nbytes=3 << 29)),
        ("25%", MemoryLimit(fraction=0.25)),
        ("0.5", MemoryLimit(fraction=0.5)),
        ("4 parsecs", None),
        ("", None),
        (float("nan"), None),
        (2.5, None),
        ([1], None),
    ],
)
def test_max_memory_values(value, limit):
    if limit is None:
        with pytest.raises(UsageError) as caught:
            checked_max_memory(value)
        assert "max_memory" in str(caught.value) and caught.value.hint
    else:
        assert checked_max_memory(value) == limit


def test_batch_size_values():
    assert checked_batch_size("auto") == "auto"
    assert checked_batch_size(8) == 8
    for bad in (0, -1, 2.0, "AUTO", True, None):
        with pytest.raises(UsageError, match="batch_size"):
            checked_batch_size(bad)


def within_budget(run: dict, budget: int) -> bool:
    """A reported model call kept to ``budget``: measured at or under it, or, unmeasured,
    predicted under the share of it below which a settled bound skips measuring."""
    if run["peak"] is not None:
        return run["peak"] <= budget
    return run["predicted"] is not None and run["predicted"] <= SETTLED_SHARE * budget


class FakeMeter:
    """A fake meter (no real memory is measured): each call "peaks" at 1 MiB per atom,
    and it counts the calls it was asked to measure."""

    name = "fake"

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self.measured = 0

    def budget(self, limit: MemoryLimit) -> int:
        return self._budget

    def measure(self, call):
        self.measured += 1
        value = call()
        return value, MIB * sum(len(atoms) for atoms in self.last)

    def release(self) -> None:
        pass


def test_a_settled_bound_stops_measuring_calls_far_under_the_budget():
    meter = FakeMeter(budget=1000 * MIB)
    sizer = ChunkSizer(meter=meter)

    def model(sub):
        meter.last = sub
        return tags(sub)

    # The probe (1, 2, 4 structures) and the calls after it are measured until the
    # bound rests on SETTLED_POINTS measured calls besides the first (a warm-up).
    batch = structures(*[4] * 40)
    assert sizer.run(batch, model) == list(range(40))
    assert meter.measured >= 4
    settled = meter.measured
    # Now a batch predicted far under half the budget runs without a measurement...
    assert sizer.run(structures(*[4] * 8), model) == list(range(8))
    assert meter.measured == settled
    runs = sizer.take_report()["batches"]
    assert runs[-1]["peak"] is None and runs[-1]["predicted"] <= SETTLED_SHARE * 1000 * MIB
    # ...and one predicted near the budget is measured again.
    assert sizer.run(structures(*[100] * 6), model) == list(range(6))
    assert meter.measured > settled
