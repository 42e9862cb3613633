"""Golden bytes for every frame rootstock's client, worker and pool daemon send.

Each frame is built from a small fixed input with today's encoder and compared with a
byte string written out below; then the golden string is read back with today's
readers and the values are checked. The strings were generated once from the
encoders of commit df89e3c (the move of the contract into ``rootstock/wire/``) and
then frozen.

A CHANGE TO A GOLDEN STRING IS A PROTOCOL BREAK. Every built env holds its own copy
of ``rootstock/wire/`` from the day it was built, and the client talks to workers
older than itself: a frame laid out differently is misread by every env built
before the change. Such a change needs a new dialect version (``"rootstock": 2`` in
``INIT``) and a rebuild hint for the old workers; see docs/protocol.md, "What may
change in wire/". Additions (a new word, a new optional JSON field, a new flag bit
with a default meaning) get a new golden string beside these, never instead of one.

The JSON parts are pinned byte for byte too (``json.dumps`` with its default
separators for ``INIT``, ``ERROR`` and the ``FORCEREADY`` extras; compact separators,
padded with spaces to a multiple of 8, in the batch bodies), although every reader
since dialect 1 parses them with ``json.loads``: their length sits in the frame and
the batch padding keeps the float64 blocks aligned, so the bytes are the contract.
The one exception is ``h^-1`` in ``POSDATA``: LAPACK's inverse may differ in the
last bit between builds, so those nine numbers are compared to 1e-14 (no rootstock
reader uses them; i-PI drivers do).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from rootstock.runtime.pool import relay
from rootstock.wire import batch as bw
from rootstock.wire import framing as p
from rootstock.worker.ipi_batch import read_message
from tests.unit.wire_streams import stream_of

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        sys.byteorder != "little",
        reason="the golden strings are little-endian; the wire is native-endian",
    ),
]


def x(text: str) -> bytes:
    """Bytes from hex (spaces are only for reading)."""
    return bytes.fromhex(text)


# --- the fixed inputs -----------------------------------------------------------------

# An ASE cell (lattice vectors as rows) that is not symmetric, so that the golden
# POSDATA pins the transpose (h has the vectors as columns).
CELL = np.array([[3.6, 0.0, 0.0], [1.8, 3.1, 0.0], [0.25, 0.5, 9.0]])
POSITIONS = np.array([[0.0, 0.0, 0.0], [1.8, 1.0, 0.5]])
# Every key the client sends in INIT, in the order RootstockCalculator builds them.
INIT_CONFIG = {
    "numbers": [29, 47],
    "pbc": [True, True, False],
    "info": {"charge": 1},
    "stress": True,
    "arrays": {"initial_magmoms": [0.0, 1.5]},
    "extras": ["magmoms"],
    "allow_nonfinite": True,
}
ENERGY = -3.5
FORCES = np.array([[0.25, -0.5, 1.0], [-0.25, 0.5, -1.0]])
# Not symmetric either, so that FORCEREADY pins the virial's transpose.
VIRIAL = np.arange(1.0, 10.0).reshape(3, 3) / 8
# The FORCEREADY extras as the worker writes them (json.dumps, default separators).
EXTRA = {
    "free_energy": -3.25,
    "model": {"dtype": "float64", "device": "cpu", "extras": ["magmoms"]},
    "magmoms": [0.0, 1.5],
}
TRACEBACK = "Traceback (most recent call last):\nNotImplementedError: No EMT-potential for U\n"


def batch_request() -> bw.BatchRequest:
    """Two structures: one with info and forwarded magmoms, one slab-like with no cell."""
    return bw.BatchRequest(
        [
            bw.BatchItem(
                numbers=np.array([29, 29]),
                pbc=np.array([True, True, True]),
                cell=CELL,
                positions=POSITIONS,
                info={"charge": 1},
                arrays={"initial_magmoms": np.array([0.0, 1.5])},
            ),
            bw.BatchItem(
                numbers=np.array([8]),
                pbc=np.array([True, False, True]),
                cell=np.zeros((3, 3)),
                positions=np.array([[0.5, 0.25, 0.125]]),
            ),
        ],
        ("energy", "forces", "stress", "energies"),
        allow_nonfinite=True,
    )


def batch_reply() -> bw.BatchReply:
    """Every flag: a full result (7), a failed structure (0), forces only (3)."""
    return bw.BatchReply(
        [
            bw.ItemResult(
                energy=-3.5,
                forces=FORCES,
                virial=VIRIAL,
                free_energy=-3.25,
                extras={"energies": np.array([-1.75, -1.75])},
            ),
            bw.ItemError("NotImplementedError", "No EMT-potential for U", TRACEBACK),
            bw.ItemResult(energy=0.5, forces=np.array([[0.0, 0.0, 0.25]])),
        ],
        model={"dtype": "float64", "extras": ["energies"]},
    )


BATCH_NATOMS = [2, 1, 1]


# --- the golden strings (frozen: read the module docstring before changing one) -------

GOLDEN_INIT_DIALECT = b"".join(
    (
        b"INIT        ",
        # bead index
        x("00000000"),
        # payload length
        x("c3000000"),
        # payload
        b'{"rootstock": 1, "numbers": [29, 47], "pbc": [true, true, false]'
        b', "info": {"charge": 1}, "stress": true, "arrays": {"initial_mag'
        b'moms": [0.0, 1.5]}, "extras": ["magmoms"], "allow_nonfinite": tr'
        b"ue}",
    )
)

GOLDEN_INIT_ASE = b"".join(
    (
        b"INIT        ",
        # bead index
        x("00000000"),
        # payload length
        x("01000000"),
        # payload
        b"\x00",
    )
)

GOLDEN_INIT_IPI = b"".join(
    (
        b"INIT        ",
        # bead index
        x("01000000"),
        # payload length
        x("0c000000"),
        # payload
        b"batch_size:4",
    )
)

GOLDEN_POSDATA = b"".join(
    (
        b"POSDATA     ",
        # h: the cell in bohr, lattice vectors as columns, C order
        x(
            "0eaddf5049361b40 0eaddf5049360b40 b9dc4d76513cde3f 0000000000000000 "
            "76f11522bf6e1740 b9dc4d76513cee3f 0000000000000000 0000000000000000 "
            "28cc8bd2ed013140"
        ),
        # h^-1 (compared to 1e-14: LAPACK's inverse may differ in the last bit)
        x(
            "18ebd345b0d0c23f d24abce592d9b5bf 801a1f718494453f 0000000000000000 "
            "d24abce592d9c53f d79735cc106c83bf 0000000000000000 0000000000000000 "
            "5babeca2b31aae3f"
        ),
        # natoms
        x("02000000"),
        # positions, bohr
        x(
            "0000000000000000 0000000000000000 0000000000000000 0eaddf5049360b40 "
            "b9dc4d76513cfe3f b9dc4d76513cee3f"
        ),
    )
)

#: FORCEREADY up to its extra bytes: the same system with or without extras.
_FORCEREADY_HEAD = b"".join(
    (
        b"FORCEREADY  ",
        # energy, hartree
        x("e9aed0cfb476c0bf"),
        # natoms
        x("02000000"),
        # forces, hartree/bohr
        x(
            "d4a705a2e3e9733f d4a705a2e3e983bf d4a705a2e3e9933f d4a705a2e3e973bf "
            "d4a705a2e3e9833f d4a705a2e3e993bf"
        ),
        # virial, hartree, transposed
        x(
            "9d355ca4ced0723f 9d355ca4ced0923f e9aed0cfb476a03f 9d355ca4ced0823f "
            "0443734d0285973f 9d355ca4ced0a23f 6b508af635398c3f 6b508af635399c3f "
            "50bce778e82aa53f"
        ),
    )
)

GOLDEN_FORCEREADY = b"".join(
    (
        _FORCEREADY_HEAD,
        # extra length
        x("00000000"),
        b"",
    )
)

GOLDEN_FORCEREADY_EXTRAS = b"".join(
    (
        _FORCEREADY_HEAD,
        # extra length
        x("74000000"),
        # extra bytes
        b'{"free_energy": -3.25, "model": {"dtype": "float64", "device": "'
        b'cpu", "extras": ["magmoms"]}, "magmoms": [0.0, 1.5]}',
    )
)

GOLDEN_ERROR = b"".join(
    (
        b"ERROR       ",
        # length
        x("bc000000"),
        # JSON
        b'{"type": "NotImplementedError", "message": "No EMT-potential for'
        b' U", "traceback": "Traceback (most recent call last):\\nNotImplem'
        b'entedError: No EMT-potential for U\\n", "phase": "calculate"}',
    )
)

GOLDEN_ERROR_DETAILS = b"".join(
    (
        b"ERROR       ",
        # length
        x("87000000"),
        # JSON
        b'{"type": "WorkerDiedError", "message": "the worker died", "trace'
        b'back": "", "phase": "pool", "exit_code": -9, "output_tail": "Kil'
        b'led\\n"}',
    )
)

GOLDEN_BATCH = b"".join(
    (
        b"BATCH       ",
        # body length
        x("94010000"),
        # n structures
        x("02000000"),
        # JSON length
        x("98000000"),
        # JSON, compact, space-padded to a multiple of 8
        b'{"properties":["energy","forces","stress","energies"],"allow_non'
        b'finite":true,"info":{"0":{"charge":1}},"arrays":{"0":{"initial_m'
        b'agmoms":[0.0,1.5]}}}    ',
        # natoms
        x("02000000 01000000"),
        # PBC masks (7; 1 + 4)
        x("07000000 05000000"),
        # cells, Å, lattice vectors as rows
        x(
            "cdcccccccccc0c40 0000000000000000 0000000000000000 cdccccccccccfc3f "
            "cdcccccccccc0840 0000000000000000 000000000000d03f 000000000000e03f "
            "0000000000002240 0000000000000000 0000000000000000 0000000000000000 "
            "0000000000000000 0000000000000000 0000000000000000 0000000000000000 "
            "0000000000000000 0000000000000000"
        ),
        # positions, Å
        x(
            "0000000000000000 0000000000000000 0000000000000000 cdccccccccccfc3f "
            "000000000000f03f 000000000000e03f 000000000000e03f 000000000000d03f "
            "000000000000c03f"
        ),
        # atomic numbers
        x("1d000000 1d000000 08000000"),
    )
)

GOLDEN_BATCHREADY = b"".join(
    (
        b"BATCHREADY  ",
        # body length
        x("18020000"),
        # n structures
        x("03000000"),
        # JSON length
        x("40010000"),
        # JSON, compact, space-padded to a multiple of 8
        b'{"errors":[{"index":1,"type":"NotImplementedError","message":"No'
        b' EMT-potential for U","traceback":"Traceback (most recent call l'
        b'ast):\\nNotImplementedError: No EMT-potential for U\\n"}],"free_en'
        b'ergy":{"0":-3.25},"extras":[{"index":0,"name":"energies","shape"'
        b':[2]}],"model":{"dtype":"float64","extras":["energies"]}}       ',
        # natoms, echoed
        x("02000000 01000000 01000000"),
        # flags: 7, 0 (the error), 3
        x("07000000 00000000 03000000"),
        # energies, eV
        x("0000000000000cc0 0000000000000000 000000000000e03f"),
        # forces of items 0 and 2, eV/Å
        x(
            "000000000000d03f 000000000000e0bf 000000000000f03f 000000000000d0bf "
            "000000000000e03f 000000000000f0bf 0000000000000000 0000000000000000 "
            "000000000000d03f"
        ),
        # virial of item 0, eV, C order
        x(
            "000000000000c03f 000000000000d03f 000000000000d83f 000000000000e03f "
            "000000000000e43f 000000000000e83f 000000000000ec3f 000000000000f03f "
            "000000000000f23f"
        ),
        # extras: item 0's energies
        x("000000000000fcbf 000000000000fcbf"),
    )
)

GOLDEN_RSDEADLINE = b"".join(
    (
        b"RSDEADLINE  ",
        # seconds
        x("0000000000000440"),
    )
)


# --- the bare words -------------------------------------------------------------------

BARE_WORDS = [
    (p.STATUS, b"STATUS      "),
    (p.READY, b"READY       "),
    (p.HAVEDATA, b"HAVEDATA    "),
    (p.NEEDINIT, b"NEEDINIT    "),
    (p.GETFORCE, b"GETFORCE    "),
    (p.EXIT, b"EXIT        "),
]
HEADERS = [
    *BARE_WORDS,
    (p.INIT, b"INIT        "),
    (p.POSDATA, b"POSDATA     "),
    (p.FORCEREADY, b"FORCEREADY  "),
    (p.ERROR, b"ERROR       "),
    (p.BATCH, b"BATCH       "),
    (p.BATCHREADY, b"BATCHREADY  "),
    (relay.DEADLINE, b"RSDEADLINE  "),
]


@pytest.mark.parametrize(("encoded", "golden"), HEADERS, ids=lambda v: v.strip().decode())
def test_every_header_is_its_word_padded_to_12_bytes(encoded, golden):
    assert encoded == golden


@pytest.mark.parametrize(("encoded", "golden"), BARE_WORDS, ids=lambda v: v.strip().decode())
def test_a_bare_word_reads_back_as_itself(encoded, golden):
    assert stream_of(golden).read_header() == golden.strip().decode()


@pytest.mark.parametrize("word", ["STATUS", "GETFORCE", "EXIT"])
def test_the_servers_bare_words_reach_the_worker_as_words(word):
    assert read_message(stream_of(word.encode().ljust(12)), body_timeout=5.0) == word


# --- INIT -----------------------------------------------------------------------------


def test_the_dialects_init():
    assert p.encode_init(INIT_CONFIG) == GOLDEN_INIT_DIALECT
    message = read_message(stream_of(GOLDEN_INIT_DIALECT), body_timeout=5.0)
    assert isinstance(message, p.Init)
    assert message.bead == 0
    assert message.dialect_config() == {"rootstock": p.DIALECT_VERSION, **INIT_CONFIG}
    assert p.DIALECT_VERSION == 1


@pytest.mark.parametrize(
    ("golden", "payload", "bead"),
    [(GOLDEN_INIT_ASE, b"\x00", 0), (GOLDEN_INIT_IPI, b"batch_size:4", 1)],
    ids=["ase", "ipi"],
)
def test_a_standard_init_string(golden, payload, bead):
    assert p.encode_init(payload, bead=bead) == golden
    message = read_message(stream_of(golden), body_timeout=5.0)
    assert message == p.Init(bead=bead, payload=payload)
    assert message.dialect_config() is None


# --- POSDATA --------------------------------------------------------------------------

_INVERSE = slice(12 + 72, 12 + 144)


def assert_posdata(frame: bytes) -> None:
    outside = [slice(0, _INVERSE.start), slice(_INVERSE.stop, None)]
    assert [frame[s] for s in outside] == [GOLDEN_POSDATA[s] for s in outside]
    np.testing.assert_allclose(
        np.frombuffer(frame[_INVERSE]), np.frombuffer(GOLDEN_POSDATA[_INVERSE]), rtol=1e-14
    )


def test_posdata():
    assert len(GOLDEN_POSDATA) == 12 + 144 + 4 + 48
    assert_posdata(p.encode_posdata(CELL, POSITIONS))
    # What the client sends: the same bytes from the encoder that caches the cell.
    encoder = p.PosDataEncoder()
    for _ in range(2):
        assert_posdata(b"".join(encoder.parts(CELL, POSITIONS)))
    message = read_message(stream_of(GOLDEN_POSDATA), body_timeout=5.0)
    assert isinstance(message, p.PosData)
    np.testing.assert_allclose(message.cell, CELL, rtol=1e-15, atol=0)
    np.testing.assert_allclose(message.positions, POSITIONS, rtol=1e-15, atol=0)


# --- FORCEREADY -----------------------------------------------------------------------


def check_forceready(reply: p.ForceReply | p.ErrorReply) -> p.ForceReply:
    assert isinstance(reply, p.ForceReply)
    assert reply.energy == pytest.approx(ENERGY, rel=1e-15)
    np.testing.assert_allclose(reply.forces, FORCES, rtol=1e-15, atol=0)
    np.testing.assert_allclose(reply.virial, VIRIAL, rtol=1e-15, atol=0)
    return reply


def test_forceready_without_extras():
    assert p.encode_forceready(ENERGY, FORCES, VIRIAL) == GOLDEN_FORCEREADY
    reply = check_forceready(p.read_reply(stream_of(GOLDEN_FORCEREADY), natoms=2))
    assert reply.extra == b""
    assert reply.extra_json() == {}


def test_forceready_with_extras():
    extra = json.dumps(EXTRA).encode("ascii")
    assert p.encode_forceready(ENERGY, FORCES, VIRIAL, extra) == GOLDEN_FORCEREADY_EXTRAS
    reply = check_forceready(p.read_reply(stream_of(GOLDEN_FORCEREADY_EXTRAS), natoms=2))
    assert reply.extra_json() == EXTRA


# --- ERROR ----------------------------------------------------------------------------


def test_error():
    frame = p.encode_error("NotImplementedError", "No EMT-potential for U", TRACEBACK, "calculate")
    assert frame == GOLDEN_ERROR
    expected = p.ErrorReply(
        type="NotImplementedError",
        message="No EMT-potential for U",
        traceback=TRACEBACK,
        phase="calculate",
    )
    # The answer to GETFORCE, and to a BATCH that fails as a whole.
    assert p.read_reply(stream_of(GOLDEN_ERROR), natoms=2) == expected
    assert bw.read_batch_reply(stream_of(GOLDEN_ERROR), BATCH_NATOMS) == expected


def test_error_with_details():
    # A pool daemon's report of its worker's death carries fields beyond the four.
    frame = p.encode_error(
        "WorkerDiedError", "the worker died", "", "pool", exit_code=-9, output_tail="Killed\n"
    )
    assert frame == GOLDEN_ERROR_DETAILS
    reply = p.read_reply(stream_of(GOLDEN_ERROR_DETAILS))
    assert reply == p.ErrorReply(
        type="WorkerDiedError",
        message="the worker died",
        traceback="",
        phase="pool",
        details={"exit_code": -9, "output_tail": "Killed\n"},
    )


# --- BATCH and BATCHREADY -------------------------------------------------------------


def test_batch():
    assert bw.encode_batch(batch_request()) == GOLDEN_BATCH
    message = read_message(stream_of(GOLDEN_BATCH), body_timeout=5.0)
    assert isinstance(message, bw.BatchRequest)
    assert message.properties == ("energy", "forces", "stress", "energies")
    assert message.allow_nonfinite is True
    for got, sent in zip(message.items, batch_request().items, strict=True):
        # No unit conversion in batch bodies: every number comes back exactly.
        assert got.numbers.tolist() == sent.numbers.tolist()
        assert got.pbc.tolist() == sent.pbc.tolist()
        assert got.cell.tolist() == sent.cell.tolist()
        assert got.positions.tolist() == sent.positions.tolist()
        assert got.info == sent.info
        assert {k: v.tolist() for k, v in got.arrays.items()} == {
            k: v.tolist() for k, v in sent.arrays.items()
        }


def test_batchready_with_every_flag_and_an_error():
    assert bw.encode_batchready(batch_reply(), BATCH_NATOMS) == GOLDEN_BATCHREADY
    reply = bw.read_batch_reply(stream_of(GOLDEN_BATCHREADY), BATCH_NATOMS)
    assert isinstance(reply, bw.BatchReply)
    assert reply.model == {"dtype": "float64", "extras": ["energies"]}
    full, failed, forces_only = reply.results
    assert isinstance(full, bw.ItemResult)
    assert full.energy == -3.5
    assert full.free_energy == -3.25
    assert full.forces is not None and full.forces.tolist() == FORCES.tolist()
    assert full.virial is not None and full.virial.tolist() == VIRIAL.tolist()
    assert {k: v.tolist() for k, v in full.extras.items()} == {"energies": [-1.75, -1.75]}
    assert failed == bw.ItemError("NotImplementedError", "No EMT-potential for U", TRACEBACK)
    assert isinstance(forces_only, bw.ItemResult)
    assert forces_only.energy == 0.5
    assert forces_only.forces is not None and forces_only.forces.tolist() == [[0.0, 0.0, 0.25]]
    assert forces_only.virial is None
    assert forces_only.free_energy is None
    assert forces_only.extras == {}
    assert (bw.FLAG_OK, bw.FLAG_FORCES, bw.FLAG_VIRIAL) == (1, 2, 4)


# --- the memory bound and report (batch_size="auto"), added beside the above ----------

GOLDEN_BATCH_WITH_MEMORY = b"".join(
    (
        b"BATCH       ",
        # body length
        x("ac000000"),
        # n structures, JSON length
        x("01000000 38000000"),
        # JSON: the optional "memory" field, after everything a BATCH had before it
        b'{"properties":["energy"],"memory":{"fraction":0.25}}    ',
        # natoms, PBC mask (none)
        x("01000000 00000000"),
        # cell (none): nine zeros
        x("00" * 72),
        # positions: the origin
        x("00" * 24),
        # atomic number: H
        x("01000000"),
    )
)

GOLDEN_BATCHREADY_WITH_MEMORY = b"".join(
    (
        b"BATCHREADY  ",
        # body length
        x("a0000000"),
        # n structures, JSON length
        x("01000000 88000000"),
        # JSON: the optional "memory" report, after the fields a BATCHREADY had before
        b'{"errors":[],"free_energy":{},"extras":[],"memory":{"meter":"rss"'
        b',"budget":4096,"batches":[{"structures":1,"atoms":1,"peak":512}]'
        b"}}     ",
        # natoms, flags (a result), energy 0.5 eV
        x("01000000 01000000 000000000000e03f"),
    )
)


def test_batch_with_a_memory_bound():
    hydrogen = bw.BatchItem(
        numbers=np.array([1]), pbc=np.zeros(3, dtype=bool), cell=np.zeros((3, 3)),
        positions=np.zeros((1, 3)),
    )  # fmt: skip
    request = bw.BatchRequest([hydrogen], ("energy",), memory=bw.MemoryLimit(fraction=0.25))
    assert bw.encode_batch(request) == GOLDEN_BATCH_WITH_MEMORY
    message = read_message(stream_of(GOLDEN_BATCH_WITH_MEMORY), body_timeout=5.0)
    assert isinstance(message, bw.BatchRequest)
    assert message.memory == bw.MemoryLimit(fraction=0.25)


def test_batchready_with_a_memory_report():
    report = {
        "meter": "rss",
        "budget": 4096,
        "batches": [{"structures": 1, "atoms": 1, "peak": 512}],
    }
    reply = bw.BatchReply([bw.ItemResult(energy=0.5)], None, report)
    assert bw.encode_batchready(reply, [1]) == GOLDEN_BATCHREADY_WITH_MEMORY
    read = bw.read_batch_reply(stream_of(GOLDEN_BATCHREADY_WITH_MEMORY), [1])
    assert isinstance(read, bw.BatchReply) and read.memory == report
    assert read.results == [bw.ItemResult(energy=0.5)]


# --- RSDEADLINE (client to pool daemon) -----------------------------------------------


def test_the_pools_deadline():
    assert relay.encode_deadline(2.5) == GOLDEN_RSDEADLINE
    assert relay.encode_deadline(None) == b"RSDEADLINE  " + bytes(8)
    frame = relay.read_client_frame(stream_of(GOLDEN_RSDEADLINE))
    assert relay.deadline_seconds(frame) == 2.5
