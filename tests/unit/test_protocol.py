"""The i-PI framing and rootstock's dialect, over real socket pairs (no processes)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rootstock.errors import ProtocolError
from rootstock.wire import framing as p
from rootstock.worker.ipi_batch import read_message
from tests.unit.wire_streams import stream_of

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_units_are_ase_units():
    import ase.units

    assert ase.units.Bohr == p.BOHR
    assert ase.units.Hartree == p.HARTREE


def test_headers_are_twelve_space_padded_bytes():
    for header in (
        p.STATUS,
        p.READY,
        p.HAVEDATA,
        p.NEEDINIT,
        p.INIT,
        p.POSDATA,
        p.GETFORCE,
        p.FORCEREADY,
        p.EXIT,
        p.ERROR,
    ):
        assert len(header) == 12
        assert header == header.rstrip().ljust(12)


def test_posdata_round_trip_matches_ase_layout():
    rng = np.random.default_rng(0)
    cell = np.array([[3.0, 0.1, 0.0], [0.2, 4.0, 0.3], [0.0, 0.0, 5.0]])
    positions = rng.normal(size=(7, 3)) * 3
    data = p.encode_posdata(cell, positions)
    # ASE's SocketIOCalculator writes h = cell.T in bohr; check the raw layout.
    h = np.frombuffer(data, np.float64, 9, 12).reshape(3, 3)
    assert np.allclose(h, cell.T / p.BOHR)
    message = read_message(stream_of(data))
    assert isinstance(message, p.PosData)
    np.testing.assert_allclose(message.cell, cell, rtol=1e-15)
    np.testing.assert_allclose(message.positions, positions, rtol=1e-14)


def test_forceready_round_trip():
    rng = np.random.default_rng(1)
    forces = rng.normal(size=(5, 3))
    virial = rng.normal(size=(3, 3))
    data = p.encode_forceready(-12.5, forces, virial, extra=b'{"free_energy": -12.0}')
    reply = p.read_reply(stream_of(data), natoms=5)
    assert isinstance(reply, p.ForceReply)
    assert reply.energy == pytest.approx(-12.5, rel=1e-15)
    np.testing.assert_allclose(reply.forces, forces, rtol=1e-14)
    np.testing.assert_allclose(reply.virial, virial, rtol=1e-14)
    assert reply.extra_json() == {"free_energy": -12.0}


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("magmoms", (4,)),
        ("magmoms", (4, 3)),
        ("charges", (4,)),
        ("energies", (4,)),
        ("dipole", (3,)),
    ],
)
def test_extras_of_the_shapes_ase_expects_are_float64_arrays(name, shape):
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape).tolist()
    array = p.extra_array(name, value, natoms=4)
    assert array.shape == shape and array.dtype == np.float64


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("magmoms", [[0.0, 1.0]] * 4, r"shape \(4, 2\), expected \(4,\) or \(4, 3\)"),
        ("charges", [0.0] * 3, r"shape \(3,\), expected \(4,\) for 4 atoms"),
        ("dipole", [0.0] * 4, r"'dipole' has shape \(4,\), expected \(3,\)"),
        ("energies", ["a", "b", "c", "d"], "not numeric"),
        ("energies", 1.0, r"shape \(\)"),
    ],
)
def test_malformed_extras_name_the_property_and_the_shapes(name, value, message):
    with pytest.raises(ValueError, match=message):
        p.extra_array(name, value, natoms=4)


def test_forceready_with_wrong_atom_count_is_a_protocol_error():
    data = p.encode_forceready(0.0, np.zeros((3, 3)), np.zeros((3, 3)))
    with pytest.raises(ProtocolError, match="3 atoms but 4"):
        p.read_reply(stream_of(data), natoms=4)


def test_init_dialect_and_standard_payloads():
    message = read_message(stream_of(p.encode_init({"numbers": [1, 8], "pbc": [0, 0, 0]})))
    assert isinstance(message, p.Init)
    config = message.dialect_config()
    assert config == {"rootstock": p.DIALECT_VERSION, "numbers": [1, 8], "pbc": [0, 0, 0]}
    # ASE sends one zero byte, i-PI its parameter string: both are standard inits.
    assert read_message(stream_of(p.encode_init(b"\x00"))).dialect_config() is None
    assert read_message(stream_of(p.encode_init(b"{}"))).dialect_config() is None
    with pytest.raises(ProtocolError, match="JSON"):
        read_message(stream_of(p.encode_init(b"{not json"))).dialect_config()


def test_error_frame_round_trip():
    data = p.encode_error("ValueError", "bad", "Traceback ...", "calculate", extra=1)
    reply = p.read_reply(stream_of(data))
    assert isinstance(reply, p.ErrorReply)
    assert (reply.type, reply.message, reply.traceback, reply.phase) == (
        "ValueError",
        "bad",
        "Traceback ...",
        "calculate",
    )
    assert reply.details == {"extra": 1}


def test_consolidated_frames_are_read_in_order():
    data = b"".join(
        (p.encode_init({"numbers": [1]}), p.encode_posdata(np.eye(3), np.zeros((1, 3))), p.GETFORCE)
    )
    stream = stream_of(data)
    assert isinstance(read_message(stream), p.Init)
    assert isinstance(read_message(stream), p.PosData)
    assert read_message(stream) == "GETFORCE"
    with pytest.raises(p.PeerClosed):
        read_message(stream)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"HELLO       ", "unknown header"),
        (b"\xff" * 12, "unknown header"),
        (p.FORCEREADY, "only a worker may send"),
        (p.POSDATA + bytes(144) + struct.pack("=i", -1), "-1 atoms"),
        (p.POSDATA + bytes(144) + struct.pack("=i", p.MAX_ATOMS + 1), "atoms"),
        (p.INIT + struct.pack("=ii", 0, -5), "-5 bytes"),
        (p.INIT + struct.pack("=ii", 0, p.MAX_PAYLOAD + 1), "bytes"),
        (p.POSDATA + bytes(10), "closed"),
    ],
)
def test_bad_frames_raise_protocol_errors(data, match):
    with pytest.raises(ProtocolError, match=match):
        read_message(stream_of(data))


def test_a_silent_peer_times_out(pair):
    reader, _writer = pair
    stream = p.FrameStream(reader, peer="silent", slice_s=0.05)
    stream.set_deadline(0.3)
    start = time.monotonic()
    with pytest.raises(p.FrameTimeout, match=r"0\.3 s"):
        stream.read_header()
    assert time.monotonic() - start < 2.0


def test_liveness_check_runs_while_waiting(pair):
    reader, _writer = pair
    stream = p.FrameStream(reader, peer="dead", slice_s=0.02)
    calls = []

    class Dead(Exception):
        pass

    def check():
        calls.append(1)
        if len(calls) >= 3:
            raise Dead

    stream.set_deadline(None, check)
    with pytest.raises(Dead):
        stream.read_header()
    assert len(calls) == 3


def test_large_frames_grow_the_buffer(pair):
    reader, writer = pair
    natoms = 20_000  # 480 KB each way: larger than the socket buffer and our buffer
    positions = np.random.default_rng(2).normal(size=(natoms, 3))
    data = p.encode_posdata(np.eye(3) * 50, positions)
    sender = threading.Thread(target=writer.sendall, args=(data,))
    sender.start()
    stream = p.FrameStream(reader, slice_s=0.05)
    stream.set_deadline(10)
    message = read_message(stream)
    sender.join(10)
    np.testing.assert_allclose(message.positions, positions, rtol=1e-14)


def test_send_to_a_closed_peer_is_peer_closed(pair):
    a, b = pair
    b.close()
    stream = p.FrameStream(a)
    stream.set_deadline(1.0)
    with pytest.raises(p.PeerClosed):
        stream.send(p.STATUS * 1000)


# --- fuzzing ---------------------------------------------------------------------------

HEADERS = [p.STATUS, p.INIT, p.POSDATA, p.GETFORCE, p.EXIT, p.FORCEREADY, p.ERROR, p.READY]


def drain(reader, data: bytes) -> None:
    """Parse ``data`` until it runs out; only ProtocolError may escape."""
    stream = stream_of(data, timeout=5.0)
    for _ in range(10_000):
        try:
            message = reader(stream)
        except ProtocolError:
            return
        if isinstance(message, p.Init):
            with contextlib.suppress(ProtocolError):
                message.dialect_config()
        if isinstance(message, p.ForceReply):
            message.extra_json()
    raise AssertionError("the parser did not stop")


frames = st.lists(st.tuples(st.sampled_from(HEADERS), st.binary(max_size=256)), max_size=8).map(
    lambda parts: b"".join(h + body for h, body in parts)
)
garbage = st.one_of(st.binary(max_size=4096), frames)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage)
def test_fuzz_worker_side_parser(data):
    drain(read_message, data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage, st.one_of(st.none(), st.integers(0, 8)))
def test_fuzz_client_side_parser(data, natoms):
    drain(lambda s: p.read_reply(s, natoms), data)
