"""The BATCH and BATCHREADY bodies: round trips over real socket pairs, and every way a
body can break the layout raising ProtocolError (never an assert or a numpy error)."""

from __future__ import annotations

import contextlib
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rootstock.errors import ProtocolError
from rootstock.wire import batch as bw
from rootstock.wire import framing as p
from rootstock.worker.ipi_batch import read_message
from tests.unit.wire_streams import stream_of

pytestmark = pytest.mark.timeout(60)


def items() -> list[bw.BatchItem]:
    rng = np.random.default_rng(3)
    return [
        bw.BatchItem(
            numbers=np.array([29, 29, 47]),
            pbc=np.array([True, True, True]),
            cell=np.diag([3.6, 3.7, 3.8]) + 0.1,
            positions=rng.normal(size=(3, 3)),
            info={"charge": 1, "tag": "a"},
            arrays={"initial_magmoms": np.array([0.0, 1.0, 2.0])},
        ),
        bw.BatchItem(
            numbers=np.array([1]),
            pbc=np.array([True, False, True]),
            cell=np.zeros((3, 3)),
            positions=np.array([[0.1, 0.2, 0.3]]),
        ),
        bw.BatchItem(
            numbers=np.array([8, 1, 1, 6]),
            pbc=np.array([False, False, False]),
            cell=np.eye(3) * 10,
            positions=rng.normal(size=(4, 3)),
            arrays={"initial_charges": np.array([0.5, -0.25, -0.25, 0.0])},
        ),
    ]


def frame_body(frame: bytes, header: bytes) -> bytes:
    assert frame[:12] == header
    (length,) = struct.unpack_from("=i", frame, 12)
    assert length == len(frame) - 16
    return frame[16:]


def test_a_batch_request_round_trips_through_read_message_exactly():
    request = bw.BatchRequest(items(), ("energy", "forces", "stress", "energies"), True)
    frame = bw.encode_batch(request)
    body = frame_body(frame, p.BATCH)
    # The JSON part is padded so the float64 blocks after it start 8-byte aligned.
    (json_len,) = struct.unpack_from("=i", body, 4)
    assert json_len % 8 == 0
    got = read_message(stream_of(frame))
    assert isinstance(got, bw.BatchRequest)
    assert got.properties == request.properties and got.allow_nonfinite is True
    assert len(got.items) == 3
    for sent, back in zip(request.items, got.items, strict=True):
        np.testing.assert_array_equal(back.numbers, sent.numbers)
        np.testing.assert_array_equal(back.pbc, sent.pbc)
        assert back.cell.tobytes() == np.asarray(sent.cell, dtype=float).tobytes()
        assert back.positions.tobytes() == np.asarray(sent.positions, dtype=float).tobytes()
        assert back.info == sent.info
        assert set(back.arrays) == set(sent.arrays)
        for name in sent.arrays:
            np.testing.assert_array_equal(back.arrays[name], sent.arrays[name])


def test_no_per_atom_json_in_a_request_without_forwarded_arrays():
    item = bw.BatchItem(
        numbers=np.full(500, 29), pbc=np.ones(3, bool), cell=np.eye(3) * 20,
        positions=np.zeros((500, 3)),
    )  # fmt: skip
    body = frame_body(bw.encode_batch(bw.BatchRequest([item], ("energy",))), p.BATCH)
    (json_len,) = struct.unpack_from("=i", body, 4)
    assert json_len <= 32
    # 8 header bytes + JSON + 4 natoms + 4 pbc + 72 cell + 24/atom positions + 4/atom numbers
    assert len(body) == 8 + json_len + 80 + 28 * 500


def reply() -> bw.BatchReply:
    return bw.BatchReply(
        [
            bw.ItemResult(
                energy=-1.5,
                forces=np.arange(9.0).reshape(3, 3),
                virial=np.arange(9.0).reshape(3, 3) * 0.1,
                free_energy=-1.25,
                extras={"energies": np.array([-0.5, -0.5, -0.5]), "dipole": np.ones(3)},
            ),
            bw.ItemError("NotImplementedError", "No EMT-potential for U", "Traceback ..."),
            bw.ItemResult(energy=np.nan, forces=np.zeros((4, 3))),
        ],
        model={"dtype": "float64", "extras": ["energies"]},
    )


def test_a_batch_reply_round_trips_with_errors_extras_and_nan():
    frame = bw.encode_batchready(reply(), [3, 1, 4])
    back = bw.read_batch_reply(stream_of(frame), [3, 1, 4])
    assert isinstance(back, bw.BatchReply)
    assert back.model == {"dtype": "float64", "extras": ["energies"]}
    first, second, third = back.results
    assert isinstance(first, bw.ItemResult) and isinstance(third, bw.ItemResult)
    assert first.energy == -1.5 and first.free_energy == -1.25
    np.testing.assert_array_equal(first.forces, np.arange(9.0).reshape(3, 3))
    np.testing.assert_array_equal(first.virial, np.arange(9.0).reshape(3, 3) * 0.1)
    assert set(first.extras) == {"energies", "dipole"}
    np.testing.assert_array_equal(first.extras["energies"], [-0.5] * 3)
    assert second == bw.ItemError("NotImplementedError", "No EMT-potential for U", "Traceback ...")
    assert np.isnan(third.energy) and third.virial is None and third.free_energy is None
    assert third.forces.shape == (4, 3)


def test_an_error_frame_answers_a_batch_too():
    frame = p.encode_error("RuntimeError", "setup failed", "tb", "setup")
    back = bw.read_batch_reply(stream_of(frame), [1])
    assert isinstance(back, p.ErrorReply) and back.phase == "setup"


def test_encoders_refuse_what_would_break_the_layout():
    with pytest.raises(ValueError, match="at least one"):
        bw.encode_batch(bw.BatchRequest([], ("energy",)))
    with pytest.raises(ValueError, match="unknown batch properties"):
        bw.encode_batch(bw.BatchRequest(items(), ("energy", "spin")))
    bad = bw.BatchReply([bw.ItemResult(energy=0.0, forces=np.zeros((2, 3)))])
    with pytest.raises(ValueError, match="forces of shape"):
        bw.encode_batchready(bad, [3])
    with pytest.raises(ValueError, match="results for"):
        bw.encode_batchready(bad, [2, 2])


# --- malformed bodies -----------------------------------------------------------------


def body(count: int, doc: dict, *blocks: np.ndarray, pad: bool = True) -> bytes:
    raw = json.dumps(doc).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("=ii", count, len(raw)) + raw + b"".join(b.tobytes() for b in blocks)


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def f64(n: int) -> np.ndarray:
    return np.zeros(n)


GOOD_REQUEST = body(1, {"properties": ["energy"]}, i32(2), i32(7), f64(9), f64(6), i32(1, 1))


@pytest.mark.parametrize(
    "data, match",
    [
        (GOOD_REQUEST[:-1], "too short"),
        (GOOD_REQUEST + b"\0", "after its last block"),
        (body(0, {"properties": []}), "declares 0 items"),
        (body(-5, {"properties": []}), "declares -5 items"),
        (struct.pack("=ii", 1, 1 << 30), "too short"),
        (struct.pack("=ii", 1, 8) + b"[1]     ", "not a JSON object"),
        (struct.pack("=ii", 1, 8) + b"\xff" * 8, "not valid UTF-8 JSON"),
        (body(1, {"properties": ["spin"]}, i32(1), i32(7), f64(9), f64(3), i32(1)), "properties"),
        (body(1, {"properties": "energy"}, i32(1), i32(7), f64(9), f64(3), i32(1)), "properties"),
        (
            body(1, {"properties": [], "allow_nonfinite": 1}, i32(1), i32(7), f64(9), f64(3),
                 i32(1)),
            "allow_nonfinite",
        ),
        (body(1, {"properties": []}, i32(0), i32(7), f64(9), i32(1)), "atom count outside"),
        (body(1, {"properties": []}, i32(1 << 25), i32(7), f64(9)), "atom count outside"),
        (body(2, {"properties": []}, i32(1 << 23, 1 << 23 + 1)), "more than"),
        (body(1, {"properties": []}, i32(1), i32(9), f64(9), f64(3), i32(1)), "PBC mask"),
        (body(1, {"properties": []}, i32(1), i32(7), f64(9), f64(3), i32(200)), "atomic number"),
        (body(1, {"properties": []}, i32(1), i32(7), f64(9), f64(3), i32(-1)), "atomic number"),
        (
            body(1, {"properties": [], "info": {"1": {}}}, i32(1), i32(7), f64(9), f64(3), i32(1)),
            "not an item index",
        ),
        (
            body(1, {"properties": [], "info": {"0": 5}}, i32(1), i32(7), f64(9), f64(3), i32(1)),
            "not a JSON object",
        ),
        (
            body(1, {"properties": [], "arrays": {"0": {"masses": [1]}}}, i32(1), i32(7), f64(9),
                 f64(3), i32(1)),
            "unknown array",
        ),
        (
            body(1, {"properties": [], "arrays": {"0": {"initial_magmoms": [1, 2]}}}, i32(1),
                 i32(7), f64(9), f64(3), i32(1)),
            "shape",
        ),
    ],
)  # fmt: skip
def test_malformed_batch_bodies_raise_protocol_errors(data, match):
    with pytest.raises(ProtocolError, match=match):
        bw.decode_batch_body(data)


def reply_body(doc: dict, natoms=(2,), flags=(7,), energies=1, forces=6, virials=9, extra=0):
    return body(
        len(natoms), doc, i32(*natoms), i32(*flags), f64(energies), f64(forces), f64(virials),
        f64(extra),
    )  # fmt: skip


@pytest.mark.parametrize(
    "data, sent, match",
    [
        (reply_body({}), [3], "were sent"),
        (reply_body({}), [2, 2], "were sent"),
        (reply_body({}, flags=(9,)), None, "unknown item flag"),
        (reply_body({}, flags=(0,), forces=0, virials=0), None, "neither a result nor an error"),
        (reply_body({"errors": [{"index": 0, "type": "E", "message": "m"}]}), None, "both"),
        (reply_body({"errors": [{"index": 3, "type": "E", "message": "m"}]}), None, "error entry"),
        (reply_body({"errors": {"0": 1}}), None, "not a JSON list"),
        (reply_body({"extras": [{"index": 0, "name": "spin", "shape": [2]}]}), None, "extras"),
        (reply_body({"extras": [{"index": 0, "name": "energies", "shape": [2]}]}), None, "short"),
        (
            reply_body({"extras": [{"index": 0, "name": "energies", "shape": [3]}]}, extra=3),
            None,
            "shape",
        ),
        (reply_body({"free_energy": {"0": "x"}}), None, "not a number"),
        (reply_body({"free_energy": {"5": 1.0}}), None, "not an item index"),
        (reply_body({"model": [1]}), None, "model report"),
        (reply_body({}, forces=5), None, "too short"),
        (reply_body({}, virials=10), None, "after its last block"),
    ],
)
def test_malformed_batch_replies_raise_protocol_errors(data, sent, match):
    with pytest.raises(ProtocolError, match=match):
        bw.decode_batchready_body(data, sent)


def test_a_batch_body_length_over_the_cap_is_refused_before_reading():
    frame = p.BATCH + struct.pack("=i", p.MAX_PAYLOAD + 1)
    with pytest.raises(ProtocolError, match="declares"):
        read_message(stream_of(frame))
    with pytest.raises(ProtocolError, match="declares"):
        bw.read_batch_reply(stream_of(p.BATCHREADY + struct.pack("=i", -1)), [1])


GOOD_REPLY = bw.encode_batchready(reply(), [3, 1, 4])[16:]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64), st.integers(0, 400), st.integers(0, 400))
def test_fuzz_batch_decoders_raise_only_protocol_errors(data, at, cut):
    """Bytes spliced into and cut from valid bodies: a ProtocolError or a clean decode."""
    for decode, good in (
        (bw.decode_batch_body, GOOD_REQUEST),
        (bw.decode_batchready_body, GOOD_REPLY),
    ):
        at = at % (len(good) + 1)
        mutated = (good[:at] + data + good[at + len(data) :])[: max(len(good) - cut, 0) or None]
        with contextlib.suppress(ProtocolError):
            decode(mutated)
