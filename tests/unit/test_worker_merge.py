"""``RSMERGE`` in the worker, in-process over a socket pair: several clients' single
calls as one hook call, each answered as it would have been alone; and the pool's
merge policy and counters, as plain objects.

The model is ASE's EMT with an ``evaluate_batch`` hook that runs EMT per structure.
"""

from __future__ import annotations

import collections
import json
import struct
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock.runtime.pool.merging import MergePolicy, PoolStats
from rootstock.wire import framing as p
from rootstock.worker.model import ModelRunner
from tests.unit.test_ipi_batch_loop import EmtBatchHook, Served

pytestmark = pytest.mark.timeout(60)


def system(symbol: str, repeat: int, seed: int):
    atoms = bulk(symbol, "fcc", cubic=True).repeat((repeat, 1, 1))
    atoms.rattle(0.05, seed=seed)
    return atoms


def init_of(atoms, **extra) -> bytes:
    config = {
        "rootstock": "test",
        "numbers": atoms.numbers.tolist(),
        "pbc": atoms.pbc.tolist(),
        "stress": True,
        **extra,
    }
    return p.encode_init(config)


def call(atoms, init: bool = True, **extra) -> bytes:
    head = init_of(atoms, **extra) if init else b""
    return head + p.encode_posdata(atoms.cell.array, atoms.positions) + p.GETFORCE


def merge(*calls: bytes) -> bytes:
    return p.RSMERGE + struct.pack("=i", len(calls)) + b"".join(calls)


def loop(hook=None) -> Served:
    return Served({"runner": ModelRunner(EMT()), "inband_errors": True, "batch_hook": hook})


def expected(atoms) -> tuple[float, np.ndarray, np.ndarray]:
    ref = atoms.copy()
    ref.calc = EMT()
    return ref.get_potential_energy(), ref.get_forces(), ref.get_stress(voigt=False)


def assert_reply_is(reply, atoms) -> None:
    assert isinstance(reply, p.ForceReply), reply
    energy, forces, stress = expected(atoms)
    assert reply.energy == pytest.approx(energy, rel=0, abs=1e-12)
    np.testing.assert_allclose(reply.forces, forces, rtol=0, atol=1e-12)
    np.testing.assert_allclose(reply.virial, -atoms.get_volume() * stress, rtol=0, atol=1e-10)


def model_report(reply: p.ForceReply) -> dict | None:
    return reply.extra_json().get("model")


def test_merged_calls_are_one_hook_call_answered_as_single_calls():
    hook = EmtBatchHook()
    served = loop(hook)
    cu, ag, cu2 = system("Cu", 1, 1), system("Ag", 2, 2), system("Cu", 1, 3)
    try:
        # A lone single call first: its model report says the worker takes RSMERGE.
        served.server.sendall(call(cu))
        first = p.read_reply(served.stream, len(cu))
        assert_reply_is(first, cu)
        assert model_report(first)["merge"] is True
        # Cu (no INIT: the worker holds Cu), Ag (its INIT), then Cu again (INIT again).
        served.server.sendall(merge(call(cu2, init=False), call(ag), call(cu)))
        replies = [p.read_reply(served.stream, len(a)) for a in (cu2, ag, cu)]
        # The hook got the three together (the worker's first sized calls probe its
        # memory with growing sub-batches, so they may come as 1 + 2).
        assert sum(size for size, _ in hook.calls) == 3 and len(hook.calls) <= 2
        assert {props for _, props in hook.calls} == {("energy", "forces", "stress")}
        for reply, atoms in zip(replies, (cu2, ag, cu), strict=True):
            assert_reply_is(reply, atoms)
        # The report goes out as in single calls: after each INIT, not before.
        assert [model_report(r) is not None for r in replies] == [False, True, True]
        # The worker's single-call system is now the last one sent (Cu).
        served.server.sendall(p.encode_posdata(cu2.cell.array, cu2.positions) + p.GETFORCE)
        assert_reply_is(p.read_reply(served.stream, len(cu2)), cu2)
        assert served.finish() == 0
    finally:
        served.server.close()


def test_a_failing_structure_or_init_fails_only_its_own_call():
    hook = EmtBatchHook()
    served = loop(hook)
    cu, ag = system("Cu", 1, 1), system("Ag", 1, 2)
    uranium = system("Cu", 1, 4)
    uranium.numbers[0] = 92  # EMT has no potential for U
    bad_init = p.encode_init(b'{"rootstock": "test", "numbers": "not a list"}')
    bad = bad_init + p.encode_posdata(cu.cell.array, cu.positions) + p.GETFORCE
    try:
        served.server.sendall(merge(call(cu), call(uranium), bad, call(ag)))
        replies = [p.read_reply(served.stream, n) for n in (len(cu), len(uranium), 4, len(ag))]
        assert_reply_is(replies[0], cu)
        assert isinstance(replies[1], p.ErrorReply) and replies[1].phase == "calculate"
        assert "U" in replies[1].message
        assert isinstance(replies[2], p.ErrorReply) and replies[2].phase == "init"
        assert_reply_is(replies[3], ag)
        assert served.finish() == 0
    finally:
        served.server.close()


def test_calls_that_ask_differently_go_to_the_hook_apart():
    hook = EmtBatchHook()
    served = loop(hook)
    cu, ag = system("Cu", 1, 1), system("Ag", 1, 2)
    try:
        served.server.sendall(merge(call(cu), call(ag, stress=False)))
        replies = [p.read_reply(served.stream, len(a)) for a in (cu, ag)]
        assert sorted(hook.calls) == [
            (1, ("energy", "forces")),
            (1, ("energy", "forces", "stress")),
        ]
        assert_reply_is(replies[0], cu)
        assert isinstance(replies[1], p.ForceReply)
        assert not replies[1].virial.any()  # no stress asked for: a zero virial, as alone
        assert served.finish() == 0
    finally:
        served.server.close()


def test_a_worker_without_a_hook_neither_advertises_nor_takes_merges(monkeypatch):
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    served = loop(hook=None)
    cu = system("Cu", 1, 1)
    try:
        served.server.sendall(call(cu))
        reply = p.read_reply(served.stream, len(cu))
        assert "merge" not in model_report(reply)
        served.server.sendall(merge(call(cu)))
        served.thread.join(10)
        # It stopped (the worker exits 3): a daemon out of step is not guessed at.
        assert not served.thread.is_alive()
        assert len(raised) == 1 and "no evaluate_batch hook" in str(raised[0])
    finally:
        served.server.close()


# --- the daemon's policy and counters ---------------------------------------------------


@dataclass
class Waiting:
    name: str
    mergeable: bool = True
    natoms: int = 4
    arrived: float = field(default=0.0)


def queue(*items: Waiting) -> collections.deque[Waiting]:
    return collections.deque(items)


def names(items) -> list[str]:
    return [item.name for item in items]


def test_a_turn_takes_the_mergeable_calls_in_arrival_order_and_a_batch_alone():
    policy = MergePolicy()
    waiting = queue(Waiting("a"), Waiting("B", mergeable=False), Waiting("c"), Waiting("d"))
    assert names(policy.take(waiting, worker_merges=True)) == ["a", "c", "d"]
    assert names(waiting) == ["B"]  # passed once: it heads the next turn, alone
    assert names(policy.take(waiting, worker_merges=True)) == ["B"]
    # A batch at the head goes alone even with mergeable calls behind it.
    waiting = queue(Waiting("B", mergeable=False), Waiting("a"))
    assert names(policy.take(waiting, worker_merges=True)) == ["B"]


@pytest.mark.parametrize(
    ("policy", "worker_merges"),
    [(MergePolicy(enabled=False), True), (MergePolicy(), False), (MergePolicy(), None)],
)
def test_without_merging_each_turn_is_one_request(policy, worker_merges):
    waiting = queue(Waiting("a"), Waiting("b"))
    assert names(policy.take(waiting, worker_merges)) == ["a"]


def test_a_turn_stops_at_its_call_and_atom_bounds():
    policy = MergePolicy(max_calls=3, max_atoms=10)
    waiting = queue(*(Waiting(str(i), natoms=3) for i in range(5)))
    assert names(policy.take(waiting, True)) == ["0", "1", "2"]
    big = queue(Waiting("big", natoms=50), Waiting("small", natoms=1))
    assert names(policy.take(big, True)) == ["big"]  # the head always goes


def test_gathering_waits_only_while_someone_else_may_still_come():
    policy = MergePolicy(max_wait_s=0.2, max_calls=3)
    assert policy.gathering(queue(Waiting("a")), True, clients=2) == 0.2
    assert policy.gathering(queue(Waiting("a"), Waiting("b")), True, clients=2) == 0.0
    assert policy.gathering(queue(*(Waiting(str(i)) for i in range(3))), True, clients=9) == 0.0
    assert MergePolicy().gathering(queue(Waiting("a")), True, clients=2) == 0.0
    assert policy.gathering(queue(Waiting("a")), None, clients=2) == 0.0


@pytest.mark.parametrize(
    ("environ", "enabled", "wait"),
    [
        ({}, True, 0.0),
        ({"ROOTSTOCK_POOL_MERGE": "0"}, False, 0.0),
        ({"ROOTSTOCK_POOL_MERGE": "off", "ROOTSTOCK_POOL_MAX_WAIT_MS": "5"}, False, 0.005),
        ({"ROOTSTOCK_POOL_MAX_WAIT_MS": "nonsense"}, True, 0.0),
        ({"ROOTSTOCK_POOL_MAX_WAIT_MS": "-3"}, True, 0.0),
    ],
)
def test_the_policy_comes_from_the_daemons_environment(environ, enabled, wait):
    policy = MergePolicy.from_environment(environ)
    assert (policy.enabled, policy.max_wait_s) == (enabled, wait)


def test_the_counters_summarise_turns_and_queue_waits():
    stats = PoolStats()
    assert stats.summary()["queue_wait_ms"] == {"p50": None, "p99": None}
    stats.record_turn([0.001], singles=1)
    stats.record_turn([0.002, 0.003, 0.004], singles=3)
    stats.record_turn([0.010], singles=0)  # a client's own BATCH
    summary = stats.summary()
    assert summary["requests"] == 5 and summary["batches"] == 3
    assert summary["merged_batches"] == 1 and summary["batch_size_max"] == 3
    assert summary["batch_size_mean"] == 2.0
    assert summary["queue_wait_ms"]["p50"] == pytest.approx(3.0)
    assert summary["queue_wait_ms"]["p99"] == pytest.approx(10.0)
    assert json.loads(json.dumps(summary)) == summary
