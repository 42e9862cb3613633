"""A pooled worker's faults: a malformed reply, an overrun deadline, a death in setup(),
and hostile frames from one client, none of which may wedge or mislead the others.

The worker is the malformed-results test env (EMT that misbehaves on request, see
tests/envs/malformed_results.py) or the runtime root's EMT; clients are real
pooled calculators, plus raw socket clients that send what no calculator would.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator
from rootstock.errors import WorkerDiedError, WorkerError, WorkerTimeout
from rootstock.ops.workers import PooledWorker, list_workers
from rootstock.wire.framing import (
    ERROR,
    FORCEREADY,
    GETFORCE,
    HEADER_LEN,
    READY,
    STATUS,
    encode_init,
    encode_posdata,
)
from tests.integration.killing import is_running, is_stopped
from tests.integration.pooling import pooled, wait_for
from tests.integration.structures import cu, emt_energy

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(600)]

ROGUE = "malformed-results"
BATCH = b"BATCH".ljust(HEADER_LEN)


def rogue_calc(root: Path, **kwargs) -> RootstockCalculator:
    kwargs.setdefault("shared", False)
    return RootstockCalculator(ROGUE, root=root, device="cpu", pool=True, **kwargs)


def one_worker():
    (worker,) = list_workers()
    return worker


@contextlib.contextmanager
def warm_rogue(root: Path, remember) -> Iterator[tuple[Atoms, RootstockCalculator, PooledWorker]]:
    """A pooled rogue calculator that has computed once: its atoms, itself and its worker."""
    atoms = cu(1, a=3.6)
    with rogue_calc(root, timeout=60) as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        remember()
        yield atoms, calc, one_worker()


# --- item 3: a malformed reply, and a deadline --------------------------------------


def test_a_reply_declaring_millions_of_atoms_fails_at_once_and_frees_the_pool(
    malformed_root, pool_dir
):
    _, remember = pool_dir
    good, bad = cu(1, a=3.6), cu(1, seed=1, a=3.6)
    bad.info["malformed"] = {"rogue_reply": True}
    # No timeout: before the fix the daemon waited for 400 MB that never came,
    # holding the worker lock, and this test hung until pytest's timeout.
    with (
        rogue_calc(malformed_root, timeout=None) as bystander,
        rogue_calc(malformed_root, timeout=None) as victim,
    ):
        good.calc, bad.calc = bystander, victim
        assert good.get_potential_energy() == pytest.approx(emt_energy(good), abs=1e-10)
        remember()
        worker = one_worker()
        with pytest.raises(WorkerError, match="declares 16777216 atoms") as info:
            bad.get_potential_energy()
        assert "pool daemon stopped it" in str(info.value)
        wait_for(lambda: not is_running(worker.worker_pid), 30, "the rogue worker to be stopped")
        wait_for(lambda: not is_running(worker.daemon_pid), 30, "the pool daemon to exit")
        # The bystander's connection went with the daemon; it attaches afresh.
        good.rattle(0.01, seed=9)
        with pytest.raises(WorkerDiedError):
            good.get_potential_energy()
        assert good.get_potential_energy() == pytest.approx(emt_energy(good), abs=1e-10)
        assert bystander.worker_pid not in (None, worker.worker_pid)
        remember()
    log = Path(worker.log).read_text()
    assert "Traceback" not in log, log[-3000:]


def test_a_call_past_its_timeout_stops_the_pooled_worker_and_says_so(malformed_root, pool_dir):
    _, remember = pool_dir
    with warm_rogue(malformed_root, remember) as (atoms, calc, worker):
        calc.timeout = 2.0
        atoms.info["malformed"] = {"sleep": 600}
        with pytest.raises(WorkerTimeout, match="did not answer within the caller's 2 s") as info:
            atoms.get_potential_energy()
        assert "the pool daemon stopped it" in str(info.value)
        # What the message says is what happened: the worker is gone.
        wait_for(lambda: not is_running(worker.worker_pid), 30, "the timed-out worker to stop")
        calc.timeout = 60
        del atoms.info["malformed"]
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        remember()


def test_a_daemon_giving_no_verdict_leaves_the_client_saying_the_worker_runs_on(
    malformed_root, pool_dir, monkeypatch
):
    # The daemon normally enforces the caller's deadline and says what it did; if it
    # says nothing (here: stopped by SIGSTOP), the client gives up on its own and must
    # not claim that anything was stopped.
    from rootstock.runtime.pool import client as pool_client

    _, remember = pool_dir
    with warm_rogue(malformed_root, remember) as (atoms, calc, worker):
        monkeypatch.setattr(pool_client, "VERDICT_GRACE_S", 0.5)
        calc.timeout = 1.0
        atoms.rattle(0.01, seed=9)
        assert worker.daemon_pid is not None and worker.worker_pid is not None
        os.kill(worker.daemon_pid, signal.SIGSTOP)
        try:
            wait_for(lambda: is_stopped(worker.daemon_pid), 60, "the daemon to stop")
            with pytest.raises(WorkerTimeout, match=r"did not answer within 1\.5 s") as info:
                atoms.get_potential_energy()
            message = f"{info.value} {info.value.hint}"
            assert "was not stopped and may still be computing" in message
            assert f"rootstock workers stop {worker.id}" in message
            # What the message says is what is so: the daemon and its worker are there.
            assert is_running(worker.daemon_pid) and is_running(worker.worker_pid)
        finally:
            os.kill(worker.daemon_pid, signal.SIGCONT)
        calc.timeout = 60
        atoms.rattle(0.01, seed=10)
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        remember()


def test_a_call_waiting_too_long_for_a_busy_worker_leaves_it_running(malformed_root, pool_dir):
    _, remember = pool_dir
    slow, waiting = cu(1, a=3.6), cu(1, seed=2, a=3.6)
    slow.info["malformed"] = {"sleep": 8}
    with rogue_calc(malformed_root, timeout=120) as a, rogue_calc(malformed_root, timeout=120) as b:
        slow.calc, waiting.calc = a, b
        waiting.get_potential_energy()
        remember()
        worker = one_worker()
        busy = threading.Thread(target=slow.get_potential_energy)
        busy.start()
        try:
            wait_for(lambda: one_worker().clients == 2, 30, "both clients attached")
            time.sleep(1.0)  # the slow call holds the worker by now
            b.timeout = 1.0
            waiting.rattle(0.01, seed=4)
            with pytest.raises(WorkerTimeout, match="busy with other clients"):
                waiting.get_potential_energy()
        finally:
            busy.join(120)
        assert is_running(worker.worker_pid)
        b.timeout = 120
        assert waiting.get_potential_energy() == pytest.approx(emt_energy(waiting), abs=1e-10)
        assert b.worker_pid == worker.worker_pid


# --- item 10: a worker that dies in setup() ----------------------------------------


def test_a_worker_exiting_in_setup_reports_its_own_code_and_output(malformed_root, pool_dir):
    atoms = cu(1, a=3.6)
    for attempt in range(2):  # the second daemon of the key must not show the first's log
        with rogue_calc(malformed_root, setup_kwargs={"exit_in_setup": 7}) as calc:
            atoms.calc = calc
            with pytest.raises(WorkerDiedError, match="exited with code 7 while starting") as info:
                atoms.get_potential_energy()
        assert info.value.worker_exit_code == 7, attempt
        tail = info.value.output_tail
        assert tail.count("malformed-results: exiting inside setup()") == 1, tail
        assert "Traceback" not in tail and "pool daemon" not in tail, tail
    assert list_workers() == []


# --- item 5 and the fuzz test: hostile frames from one client -----------------------


class RawClient:
    """A connection to the daemon that sends whatever bytes it is given."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(path)
        self.sock.sendall(STATUS)
        assert self.recv(HEADER_LEN) == READY

    def recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def error_reply(self) -> dict:
        header = self.recv(HEADER_LEN)
        assert header == ERROR, header
        (length,) = struct.unpack("=i", self.recv(4))
        return json.loads(self.recv(length))

    def close(self) -> None:
        self.sock.close()


def posdata(natoms: int = 4) -> bytes:
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((max(natoms // 4, 1), 1, 1))
    return encode_posdata(atoms.cell.array, atoms.positions)


def deep_init(depth: int = 100_000) -> bytes:
    return encode_init(b'{"rootstock": 1, "info": ' + b"[" * depth + b"]" * depth + b"}")


def batch(body: bytes) -> bytes:
    return BATCH + struct.pack("=i", len(body)) + body


def test_a_clients_bad_frames_fail_that_client_alone(fake_built_root, pool_dir):
    _, remember = pool_dir
    atoms = cu(1, a=3.6)
    with pooled(fake_built_root, shared=False) as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        remember()
        worker = one_worker()
        raw = RawClient(worker.socket)
        try:
            for init in (encode_init(b"{not json"), deep_init(), encode_init(b"batch_size:4")):
                raw.sock.sendall(init + posdata() + GETFORCE)
                reply = raw.error_reply()
                assert reply["type"] == "ProtocolError" and "refused this INIT" in reply["message"]
            raw.sock.sendall(batch(b"\x07" * 40))
            assert "refused this BATCH" in raw.error_reply()["message"]
            # The same connection still works for a well-formed request.
            good = encode_init(
                {"numbers": [29] * 4, "pbc": [True] * 3, "info": {}, "stress": False}
            )
            raw.sock.sendall(good + posdata() + GETFORCE)
            assert raw.recv(HEADER_LEN) == FORCEREADY
        finally:
            raw.close()
        atoms.rattle(0.02, seed=3)
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        assert calc.worker_pid == worker.worker_pid and is_running(worker.daemon_pid)


def fuzz_frames(rng: random.Random) -> list[bytes]:
    """Garbage, truncated, oversized and deep frames, as one hostile client sends them."""
    good_init = encode_init({"numbers": [29] * 4, "pbc": [True] * 3, "info": {}, "stress": True})
    whole = good_init + posdata() + GETFORCE
    return [
        rng.randbytes(rng.randint(1, 200)),  # garbage
        whole[: rng.randint(1, len(whole) - 1)],  # truncated, then the client goes
        b"INIT".ljust(HEADER_LEN) + struct.pack("=ii", 0, 1 << 30),  # oversized INIT
        b"POSDATA".ljust(HEADER_LEN) + bytes(144) + struct.pack("=i", 1 << 25),  # too many atoms
        batch(struct.pack("=ii", 1 << 20, 8) + b"{}      "),  # a BATCH that lies
        BATCH + struct.pack("=i", 1 << 27),  # an oversized BATCH
        deep_init(rng.randint(1_000, 200_000)) + posdata() + GETFORCE,  # deep JSON
        encode_init(b"{" + rng.randbytes(64)) + posdata() + GETFORCE,  # broken JSON
        batch(rng.randbytes(rng.randint(8, 400))),  # a garbage BATCH body
        good_init + posdata(8) + GETFORCE,  # 8 positions for a 4-atom system
        GETFORCE,  # no system yet
    ]


def hostile_client(path: str, seed: int, stop: threading.Event, sent: list[int]) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        frames = fuzz_frames(rng)
        rng.shuffle(frames)
        for frame in frames:
            try:
                raw = RawClient(path)
            except (OSError, AssertionError):
                continue  # the daemon is between clients; try again
            try:
                raw.sock.sendall(frame)
                raw.sock.settimeout(2)
                raw.sock.recv(4096)  # an ERROR, a closed connection, or nothing
            except OSError:
                pass
            finally:
                raw.close()
            sent.append(1)


def test_fuzzed_frames_from_one_client_leave_the_others_results_right(fake_built_root, pool_dir):
    _, remember = pool_dir
    systems = [cu(1, a=3.6), bulk("Ag", "fcc", cubic=True).repeat((2, 1, 1))]
    calcs = [pooled(fake_built_root, shared=False) for _ in systems]
    try:
        for atoms, calc in zip(systems, calcs, strict=True):
            atoms.calc = calc
            atoms.get_potential_energy()
        remember()
        worker = one_worker()
        stop, sent = threading.Event(), []
        fuzzers = [
            threading.Thread(target=hostile_client, args=(worker.socket, seed, stop, sent))
            for seed in (1, 2)
        ]
        for thread in fuzzers:
            thread.start()
        try:
            for step in range(60):
                for k, atoms in enumerate(systems):
                    atoms.rattle(0.02, seed=100 * k + step)
                    forces = atoms.get_forces()
                    ref = atoms.copy()
                    ref.calc = EMT()
                    assert atoms.get_potential_energy() == pytest.approx(
                        ref.get_potential_energy(), abs=1e-10
                    )
                    assert np.allclose(forces, ref.get_forces(), atol=1e-10, rtol=0)
        finally:
            stop.set()
            for thread in fuzzers:
                thread.join(60)
        assert len(sent) >= 11  # every kind of frame was sent at least once
        assert all(calc.worker_pid == worker.worker_pid for calc in calcs)
        assert is_running(worker.daemon_pid)
    finally:
        for calc in calcs:
            calc.close()
