"""The worker loop's new conversations, in-process over socket pairs (nothing is spawned).

* A standard i-PI server is answered NEEDINIT until its INIT; a ``batch_size:N`` in
  it makes every POSDATA carry N structures, answered in i-PI's batched FORCEREADY
  layout with, per structure, exactly what a single FORCEREADY carries.
* With the env's ``evaluate_batch`` hook, a batch is one hook call for its distinct
  structures (padding is not sent to the model); a hook that fails as a whole falls
  back to one structure at a time, with the same answers.
* Rootstock's calculator dialect is unchanged (READY before any INIT).
* A rootstock ``BATCH`` frame is answered with BATCHREADY, and leaves the single-call
  state alone; with a pending setup error, with that ERROR.

The model is ASE's EMT, a real (cheap) calculator.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock.errors import ProtocolError
from rootstock.wire import batch as bw
from rootstock.wire import framing as p
from rootstock.worker.ipi_batch import init_batch_size
from rootstock.worker.loop import EXIT_MODEL_ERROR, EXIT_OK, CapturedError, ServeLoop
from rootstock.worker.model import ModelRunner

pytestmark = pytest.mark.timeout(60)

NATOMS = 4


class Served:
    """A ServeLoop on one end of a socket pair, run in a thread; the test is the server."""

    def __init__(self, loop_kwargs: dict) -> None:
        self.server, worker = socket.socketpair()
        self.server.settimeout(10)
        self.stream = p.FrameStream(self.server, peer="worker", slice_s=0.05)
        self.stream.set_deadline(10)
        self.loop = ServeLoop(p.FrameStream(worker, peer="server"), **loop_kwargs)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.code = self.loop.run()
        finally:
            self.loop.stream.close()  # as worker/main.py does when the loop returns

    def status(self) -> str:
        self.server.sendall(p.STATUS)
        return self.stream.read_header()

    def finish(self) -> int | None:
        self.server.sendall(p.EXIT)
        self.thread.join(10)
        return self.code


def template():
    return bulk("Cu", "fcc", a=3.62, cubic=True)


def serve_runner() -> ModelRunner:
    runner = ModelRunner(EMT())
    runner.use_template(template())
    return runner


@pytest.fixture
def standard() -> Iterator[Served]:
    """What ``rootstock serve`` runs: a standard server, no in-band errors."""
    served = Served({"runner": serve_runner(), "inband_errors": False})
    yield served
    served.server.close()
    served.thread.join(10)


def geometries(count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    atoms = template()
    out = []
    for _ in range(count):
        cell = atoms.cell.array * (1 + 0.01 * rng.normal(size=(3, 3)))
        out.append((cell, atoms.positions + 0.05 * rng.normal(size=(NATOMS, 3))))
    return out


def ipi_batched_posdata(structures: list[tuple[np.ndarray, np.ndarray]]) -> bytes:
    """POSDATA as i-PI >= 3.3 writes it: natoms, then (h, h^-1) per structure, then
    the positions of each, in bohr; ``h`` has the lattice vectors as columns."""
    parts = [p.POSDATA, struct.pack("=i", NATOMS)]
    for cell, _ in structures:
        h = cell.T / p.BOHR
        parts += [h.tobytes(), np.linalg.inv(h).tobytes()]
    parts += [(positions / p.BOHR).tobytes() for _, positions in structures]
    return b"".join(parts)


def read_ipi_batched_reply(stream: p.FrameStream, count: int) -> list[tuple]:
    """A batched FORCEREADY in i-PI's layout, in its raw units (hartree, bohr)."""
    assert stream.read_header() == "FORCEREADY"
    energies = stream.read_float64s(count)
    assert stream.read_int32() == NATOMS
    forces = stream.read_float64s(count * 3 * NATOMS).reshape(count, NATOMS, 3)
    virials = stream.read_float64s(count * 9).reshape(count, 3, 3)
    extras = [stream.read_bytes(stream.read_int32()) for _ in range(count)]
    return list(zip(energies, forces, virials, extras, strict=True))


def single_replies(structures: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple]:
    """Each structure through a one-at-a-time standard server, raw units."""
    served = Served({"runner": serve_runner(), "inband_errors": False})
    try:
        assert served.status() == "NEEDINIT"
        served.server.sendall(p.encode_init(b"\0"))  # what ASE's SocketIOCalculator sends
        replies = []
        for cell, positions in structures:
            assert served.status() == "READY"
            served.server.sendall(p.encode_posdata(cell, positions) + p.GETFORCE)
            assert served.stream.read_header() == "FORCEREADY"
            energy, natoms = served.stream.read_struct(struct.Struct("=di"))
            forces = served.stream.read_float64s(3 * natoms).reshape(natoms, 3)
            virial = served.stream.read_float64s(9).reshape(3, 3)
            extra = served.stream.read_bytes(served.stream.read_int32())
            replies.append((energy, forces, virial, extra))
        assert served.finish() == EXIT_OK
    finally:
        served.server.close()
    return replies


@pytest.mark.parametrize(
    ("payload", "size"),
    [
        (b" batch_size:4", 4),  # i-PI's own string when the ffsocket has no parameters
        (b"cutoff:5.0, batch_size:16", 16),
        (b"batch_size:1", 1),
        (b"\0", 1),  # ASE's SocketIOCalculator
        (b"", 1),
        (b"some_batch_size_note", 1),
    ],
)
def test_the_batch_size_comes_from_the_init_string(payload, size):
    assert init_batch_size(p.Init(bead=0, payload=payload)) == size


@pytest.mark.parametrize("value", ["0", "-2", "four", "", str(1 << 20)])
def test_a_batch_size_that_cannot_be_right_is_a_protocol_error(value):
    with pytest.raises(ProtocolError, match="batch_size"):
        init_batch_size(p.Init(bead=0, payload=f"batch_size:{value}".encode()))


def test_a_batched_exchange_is_n_single_exchanges_bit_for_bit(standard):
    distinct = geometries(3)
    # i-PI pads a short batch by repeating its last structure.
    batch = [*distinct, distinct[-1]]
    assert standard.status() == "NEEDINIT"
    assert standard.status() == "NEEDINIT"  # until INIT arrives, however often asked
    standard.server.sendall(p.encode_init(b" batch_size:4", bead=0))
    assert standard.status() == "READY"
    assert standard.loop.ipi_batch_size == 4
    for _ in range(2):  # the batch size holds for every later exchange
        standard.server.sendall(ipi_batched_posdata(batch))
        assert standard.status() == "HAVEDATA"
        standard.server.sendall(p.GETFORCE)
        got = read_ipi_batched_reply(standard.stream, len(batch))
        assert standard.status() == "READY"
        want = single_replies(batch)
        for (e, f, v, x), (e1, f1, v1, x1) in zip(got, want, strict=True):
            assert e == e1
            assert np.array_equal(f, f1) and np.array_equal(v, v1)
            assert x == x1
    # Distinct structures got distinct answers (the padding is not all there is).
    assert len({float(e) for e, *_ in got}) == len(distinct)
    assert standard.finish() == EXIT_OK


def test_a_model_error_in_a_batch_closes_the_connection(standard):
    standard.server.sendall(p.encode_init(b" batch_size:2"))
    wrong = geometries(2)
    wrong[1] = (wrong[1][0], np.full((NATOMS, 3), np.nan))
    standard.server.sendall(ipi_batched_posdata(wrong))
    assert standard.status() == "HAVEDATA"
    standard.server.sendall(p.GETFORCE)
    standard.thread.join(10)
    # A standard server has no error frame: the worker ends, and so does the run.
    assert standard.code == EXIT_MODEL_ERROR
    assert standard.server.recv(1) == b""


def test_the_calculator_dialect_is_ready_before_any_init():
    runner = serve_runner()
    served = Served({"runner": runner, "inband_errors": True})
    try:
        # The calculator never polls STATUS; a client that does still gets READY.
        assert served.status() == "READY"
        assert served.finish() == EXIT_OK
    finally:
        served.server.close()


def calculator_loop(**kwargs) -> Served:
    runner = ModelRunner(EMT())
    return Served({"runner": runner, "inband_errors": True, **kwargs})


def batch_request() -> bw.BatchRequest:
    atoms = template()
    items = [
        bw.BatchItem(
            numbers=atoms.numbers,
            pbc=atoms.pbc,
            cell=cell,
            positions=positions,
        )
        for cell, positions in geometries(2)
    ]
    return bw.BatchRequest(items=items, properties=("energy", "forces"))


def test_a_batch_frame_gets_batchready_and_keeps_the_single_call_system():
    served = calculator_loop()
    try:
        atoms = template()
        init = {"numbers": atoms.numbers.tolist(), "pbc": [True] * 3, "stress": False}
        served.server.sendall(
            p.encode_init(init) + p.encode_posdata(atoms.cell.array, atoms.positions) + p.GETFORCE
        )
        first = p.read_reply(served.stream, NATOMS)
        assert isinstance(first, p.ForceReply)
        request = batch_request()
        served.server.sendall(bw.encode_batch(request))
        reply = bw.read_batch_reply(served.stream, [NATOMS, NATOMS])
        assert isinstance(reply, bw.BatchReply)
        for item, result in zip(request.items, reply.results, strict=True):
            assert isinstance(result, bw.ItemResult)
            ref = template()
            ref.cell[:] = item.cell
            ref.positions[:] = item.positions
            ref.calc = EMT()
            assert result.energy == pytest.approx(ref.get_potential_energy(), abs=1e-12)
            np.testing.assert_allclose(result.forces, ref.get_forces(), rtol=0, atol=1e-12)
        # After the batch, a POSDATA is computed for the system of the last INIT.
        served.server.sendall(p.encode_posdata(atoms.cell.array, atoms.positions) + p.GETFORCE)
        again = p.read_reply(served.stream, NATOMS)
        assert isinstance(again, p.ForceReply)
        assert again.energy == first.energy
        assert served.finish() == EXIT_OK
    finally:
        served.server.close()


def test_a_batch_frame_after_a_failed_setup_gets_the_setup_error():
    error = CapturedError("ImportError", "no module named torch", "Traceback ...", "setup")
    served = Served({"runner": None, "inband_errors": True, "setup_error": error})
    try:
        served.server.sendall(bw.encode_batch(batch_request()))
        reply = bw.read_batch_reply(served.stream, [NATOMS, NATOMS])
        assert isinstance(reply, p.ErrorReply)
        assert (reply.type, reply.phase) == ("ImportError", "setup")
        served.thread.join(10)
        assert served.code == EXIT_MODEL_ERROR
    finally:
        served.server.close()


class EmtBatchHook:
    """An env's ``evaluate_batch`` that runs EMT on each structure and records its calls;
    ``fail`` makes the whole batch raise, as a model without a batched path might."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[int, tuple[str, ...]]] = []

    def __call__(self, calc, atoms_list, properties):
        self.calls.append((len(atoms_list), tuple(properties)))
        if self.fail:
            raise RuntimeError("batched inference is broken")
        out = []
        for atoms in atoms_list:
            atoms.calc = EMT()
            out.append(
                {
                    "energy": atoms.get_potential_energy(),
                    "forces": atoms.get_forces(),
                    "stress": atoms.get_stress(),
                }
            )
        return out


@pytest.mark.parametrize("fail", [False, True])
def test_a_batch_goes_to_the_env_hook_once_without_its_padding(fail, caplog):
    hook = EmtBatchHook(fail=fail)
    served = Served({"runner": serve_runner(), "inband_errors": False, "batch_hook": hook})
    try:
        distinct = geometries(2)
        batch = [*distinct, distinct[-1], distinct[-1]]
        assert served.status() == "NEEDINIT"
        served.server.sendall(p.encode_init(b" batch_size:4"))
        assert served.status() == "READY"
        served.server.sendall(ipi_batched_posdata(batch) + p.GETFORCE)
        got = read_ipi_batched_reply(served.stream, len(batch))
        assert served.finish() == EXIT_OK
    finally:
        served.server.close()
    # One call for the two distinct structures; stress, as the cell is 3-D periodic.
    assert hook.calls == [(2, ("energy", "forces", "stress"))]
    # A hook that fails as a whole: the structures are computed one at a time instead.
    assert ("computing them one at a time" in caplog.text) == fail
    for (e, f, v, x), (e1, f1, v1, x1) in zip(got, single_replies(batch), strict=True):
        assert e == pytest.approx(e1, rel=0, abs=1e-14)
        np.testing.assert_allclose(f, f1, rtol=0, atol=1e-14)
        np.testing.assert_allclose(v, v1, rtol=0, atol=1e-14)
        assert x == x1 == b""
