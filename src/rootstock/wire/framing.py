"""i-PI framing over a stream socket, plus rootstock's small dialect on top of it.

Every message starts with a 12-byte header: an ASCII word padded with spaces
(``STATUS``, ``READY``, ``HAVEDATA``, ``NEEDINIT``, ``INIT``, ``POSDATA``,
``GETFORCE``, ``FORCEREADY``, ``EXIT``). Numbers travel as native-endian
``int32`` and ``float64``; lengths are bohr and energies hartree, as in i-PI.

Bodies (``h`` is the cell with the lattice vectors as *columns*, i.e. the
transpose of an ASE cell, written in C order):

* ``INIT``: int32 bead index, int32 length, that many bytes.
* ``POSDATA``: 9 float64 ``h``, 9 float64 ``h^-1``, int32 natoms, 3*natoms float64.
* ``FORCEREADY``: float64 energy, int32 natoms, 3*natoms float64 forces,
  9 float64 virial (transposed, as ASE writes it), int32 length, extra bytes.

Rootstock's dialect (see docs/protocol.md) adds two things and changes no frame:

* the ``INIT`` bytes are a JSON object ``{"rootstock": 1, "numbers": [...],
  "pbc": [...], "info": {...}, "stress": bool, ...}`` describing the system (and
  ``"allow_nonfinite": true`` when the client accepts NaN and inf), sent only when
  it changes and always in the same write as the next ``POSDATA``;
* the worker may answer ``GETFORCE`` with ``ERROR`` (int32 length + a JSON object
  with ``type``, ``message``, ``traceback`` and ``phase``) instead of
  ``FORCEREADY``. Standard i-PI servers never see ``ERROR``;
* the ``FORCEREADY`` extra bytes are a JSON object (or empty) that may carry
  ``free_energy``, the model's dtype and the extras it fills (``model``), and
  the values of the extras the client asked for in ``INIT`` (``extras``);
* ``BATCH`` (client to worker) and ``BATCHREADY`` (its answer) carry many
  structures in one round trip: header, int32 body length, body. The bodies (and
  the reply reader) are :mod:`rootstock.wire.batch`'s; a worker answers a
  BATCH that fails as a whole with ``ERROR``. Neither is ever sent to or by a
  standard i-PI peer.

This module needs only the standard library and numpy: the worker imports it
inside every model env.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rootstock.errors import ProtocolError

log = logging.getLogger("rootstock.wire")

HEADER_LEN = 12
DIALECT_VERSION = 1
# ase.units.Bohr and ase.units.Hartree (CODATA 2014), so that a round trip through
# ASE's own SocketIOCalculator reproduces our numbers bit for bit.
BOHR = 0.5291772105638411  # angstrom per bohr
HARTREE = 27.211386024367243  # eV per hartree

# Caps that keep a corrupt length field from turning into a huge allocation or a
# wait for bytes that will never come.
MAX_ATOMS = 1 << 24
MAX_PAYLOAD = 1 << 26


def _header(word: str) -> bytes:
    return word.encode("ascii").ljust(HEADER_LEN)


STATUS = _header("STATUS")
READY = _header("READY")
HAVEDATA = _header("HAVEDATA")
NEEDINIT = _header("NEEDINIT")
INIT = _header("INIT")
POSDATA = _header("POSDATA")
GETFORCE = _header("GETFORCE")
FORCEREADY = _header("FORCEREADY")
EXIT = _header("EXIT")
ERROR = _header("ERROR")
BATCH = _header("BATCH")
BATCHREADY = _header("BATCHREADY")
#: Pool daemon -> worker: ``int32`` k, then k single calls ([INIT] POSDATA GETFORCE),
#: computed as one model batch and answered by k single replies, in order. Sent only
#: to a worker whose model report says ``"merge": true`` (docs/protocol.md).
RSMERGE = _header("RSMERGE")
#: The most single calls one ``RSMERGE`` may carry.
MAX_MERGE = 1 << 12

_WORDS = {
    h: h.rstrip().decode("ascii")
    for h in (
        STATUS, READY, HAVEDATA, NEEDINIT, INIT, POSDATA, GETFORCE, FORCEREADY, EXIT, ERROR,
        BATCH, BATCHREADY,
        RSMERGE,
    )
}  # fmt: skip
#: Where a ``download``-mode worker writes the paths the env's ``download()`` hook
#: returned (a JSON list of absolute paths; docs/worker-environment.md). A variable,
#: not an option, so a worker in an env built by an older rootstock still starts
#: (it writes nothing, and its fetch is recorded from the cache scan alone).
DOWNLOAD_RESULT_ENV = "ROOTSTOCK_DOWNLOAD_RESULT"
#: ``1``: the worker refuses, before ``setup()``, a ``--device`` this node does not
#: show (verification sets it). A variable for the same reason: an older worker
#: ignores it, and its pass is recorded on the device it was asked for.
CHECK_DEVICE_ENV = "ROOTSTOCK_CHECK_DEVICE"

# What a model may compute beyond energy, forces and stress, under ASE's names; the
# client asks for them in INIT and they come back in the FORCEREADY extra JSON.
EXTRA_PROPERTIES = ("magmoms", "charges", "energies", "dipole")

_INT32 = struct.Struct("=i")
_F64_INT32 = struct.Struct("=di")
_INIT_HEAD = struct.Struct("=ii")
_SCALE_FORCE = BOHR / HARTREE


class PeerClosed(ProtocolError):
    """The other end closed the connection (or reset it)."""


class FrameTimeout(ProtocolError):
    """No complete frame arrived before the deadline."""


@dataclass(frozen=True)
class Init:
    """An ``INIT`` message: bead index and the raw initialisation bytes."""

    bead: int
    payload: bytes

    def dialect_config(self) -> dict[str, Any] | None:
        """The rootstock JSON config, or None for a standard i-PI init string."""
        if not self.payload.startswith(b"{"):
            return None
        config = _loads(self.payload, "INIT")
        if not isinstance(config, dict) or "rootstock" not in config:
            return None
        return config


@dataclass(frozen=True)
class PosData:
    """A ``POSDATA`` message, converted to an ASE cell (rows) and positions in Å."""

    cell: np.ndarray
    positions: np.ndarray


@dataclass(frozen=True)
class ForceReply:
    """A ``FORCEREADY`` reply in eV, eV/Å and eV; ``extra`` is the raw extra string."""

    energy: float
    forces: np.ndarray
    virial: np.ndarray
    extra: bytes = b""

    def extra_json(self) -> dict[str, Any]:
        """The extra string as a JSON object, or {} when it is empty or not JSON."""
        if not self.extra.startswith(b"{"):
            return {}
        try:
            value = _loads(self.extra, "FORCEREADY extra")
        except ProtocolError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ErrorReply:
    """An ``ERROR`` reply (rootstock dialect): the model raised inside the worker."""

    type: str
    message: str
    traceback: str
    phase: str
    details: dict[str, Any] = field(default_factory=dict)


def extra_array(name: str, value: Any, natoms: int) -> np.ndarray:
    """``value`` as a float64 array of the shape ASE expects for extra ``name``.

    Per-atom arrays (``charges``, ``energies``) are ``(natoms,)``; ``magmoms`` is
    ``(natoms,)`` (collinear) or ``(natoms, 3)``; ``dipole`` is ``(3,)``. Anything
    else raises ValueError naming the property and both shapes.
    """
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the model's {name!r} is not numeric ({exc})") from None
    if name == "dipole":
        allowed: tuple[tuple[int, ...], ...] = ((3,),)
    elif name == "magmoms":
        allowed = ((natoms,), (natoms, 3))
    else:
        allowed = ((natoms,),)
    if array.shape not in allowed:
        expected = " or ".join(str(shape) for shape in allowed)
        raise ValueError(
            f"the model's {name!r} has shape {array.shape}, expected {expected} for {natoms} atoms"
        )
    return array


def _loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{what} payload is not valid UTF-8 JSON: {exc}") from None


# --- encoders -------------------------------------------------------------------------


def encode_init(config: dict[str, Any] | bytes, bead: int = 0) -> bytes:
    """An ``INIT`` frame; a dict is sent as rootstock's JSON config."""
    if isinstance(config, dict):
        payload = json.dumps({"rootstock": DIALECT_VERSION, **config}).encode("utf-8")
    else:
        payload = bytes(config)
    return b"".join((INIT, _INIT_HEAD.pack(bead, len(payload)), payload))


def _cell_bytes(cell: np.ndarray) -> bytes:
    """``h`` and ``h^-1`` in bohr as they travel in POSDATA."""
    h = np.asarray(cell, dtype=np.float64).T / BOHR
    try:
        ih = np.linalg.inv(h)
    except np.linalg.LinAlgError:
        # Non-periodic or slab cells have no inverse; readers that need one (i-PI
        # drivers) only run with full cells, and the rootstock worker ignores it.
        ih = np.zeros((3, 3))
    return np.ascontiguousarray(h).tobytes() + np.ascontiguousarray(ih).tobytes()


class PosDataEncoder:
    """Builds POSDATA frames, deriving ``h`` and ``h^-1`` again only when the cell moves."""

    def __init__(self) -> None:
        self._cell_key: bytes | None = None
        self._cell_bytes = b""

    def parts(self, cell: np.ndarray, positions: np.ndarray) -> tuple[Any, ...]:
        """The buffers of one frame, for joining with other frames in a single write."""
        key = np.asarray(cell, dtype=np.float64).tobytes()
        if key != self._cell_key:
            self._cell_key, self._cell_bytes = key, _cell_bytes(cell)
        pos = np.ascontiguousarray(np.asarray(positions, dtype=np.float64) / BOHR)
        return (POSDATA, self._cell_bytes, _INT32.pack(len(pos)), pos)


def encode_posdata(cell: np.ndarray, positions: np.ndarray) -> bytes:
    """A ``POSDATA`` frame from an ASE cell (vectors as rows) and positions in Å."""
    # bytes.join takes buffer objects, so the positions are copied exactly once.
    return b"".join(PosDataEncoder().parts(cell, positions))


def encode_forceready(
    energy: float, forces: np.ndarray, virial: np.ndarray, extra: bytes = b""
) -> bytes:
    """A ``FORCEREADY`` frame from eV, eV/Å and an eV virial (3x3).

    Forces must be ``(natoms, 3)`` and the virial 3x3: any other shape would be
    written with a length that does not match its bytes and put the reader out of
    step, so it raises ValueError instead (the worker checks results first).
    """
    f = np.asarray(forces, dtype=np.float64) * _SCALE_FORCE
    if f.ndim != 2 or f.shape[1] != 3:
        raise ValueError(f"forces of shape {f.shape} cannot be sent; expected (natoms, 3)")
    v = np.asarray(virial, dtype=np.float64)
    if v.shape != (3, 3):
        raise ValueError(f"a virial of shape {v.shape} cannot be sent; expected (3, 3)")
    v = np.ascontiguousarray(v.T / HARTREE)
    return b"".join(
        (  # type: ignore[arg-type]  # ndarray is a buffer; numpy types __buffer__ for 3.12+ only
            FORCEREADY,
            _F64_INT32.pack(float(energy) / HARTREE, len(f)),
            np.ascontiguousarray(f),
            v,
            _INT32.pack(len(extra)),
            extra,
        )
    )


def encode_error(type_: str, message: str, traceback: str, phase: str, **details: Any) -> bytes:
    """An ``ERROR`` frame (rootstock dialect only)."""
    payload = json.dumps(
        {"type": type_, "message": message, "traceback": traceback, "phase": phase, **details}
    ).encode("utf-8")
    return b"".join((ERROR, _INT32.pack(len(payload)), payload))


# --- the buffered stream --------------------------------------------------------------


class FrameStream:
    """Exact-length reads and whole-frame writes over a connected socket.

    Reads go through one growing buffer, so a frame that is already in the socket
    usually costs a single ``recv``. Every wait is cut into slices of ``slice_s``
    seconds; between slices the deadline is checked and ``on_wait`` (a liveness
    check of the peer process) is called, which may raise.
    """

    def __init__(self, sock: socket.socket, *, peer: str = "peer", slice_s: float = 0.5) -> None:
        self.sock = sock
        self.peer = peer
        self.slice_s = slice_s
        self._buf = np.empty(1 << 16, dtype=np.uint8)
        self._start = 0
        self._end = 0
        self._timeout: float | None = None
        self._deadline: float | None = None
        self._on_wait: Callable[[], None] | None = None
        sock.settimeout(slice_s)

    def set_deadline(
        self, timeout: float | None, on_wait: Callable[[], None] | None = None
    ) -> None:
        """Bound the next reads and writes by ``timeout`` seconds from now (None: no bound)."""
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._on_wait = on_wait

    def close(self) -> None:
        """Close the socket; safe to call twice."""
        with contextlib.suppress(OSError):
            self.sock.close()

    # reads ----------------------------------------------------------------------------

    def _waited(self) -> None:
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise FrameTimeout(f"no complete frame from the {self.peer} within {self._timeout:g} s")
        if self._on_wait is not None:
            self._on_wait()

    def _fill(self, n: int) -> None:
        """Buffer at least ``n`` unread bytes, reading as much as the socket has."""
        if self._start == self._end:
            self._start = self._end = 0
        if len(self._buf) - self._start < n:
            avail = self._end - self._start
            if len(self._buf) < n:
                # Callers validate n against MAX_* first; np.empty only reserves pages.
                grown = np.empty(max(n, 2 * len(self._buf)), dtype=np.uint8)
                grown[:avail] = self._buf[self._start : self._end]
                self._buf = grown
            else:
                self._buf[:avail] = self._buf[self._start : self._end]
            self._start, self._end = 0, avail
        while self._end - self._start < n:
            try:
                got = self.sock.recv_into(self._buf[self._end :])  # type: ignore[arg-type]  # ndarray is a buffer; numpy types __buffer__ for 3.12+ only
            except TimeoutError:
                self._waited()
                continue
            except ConnectionError as exc:
                raise PeerClosed(f"the {self.peer} closed the connection ({exc})") from None
            except OSError as exc:
                raise ProtocolError(f"reading from the {self.peer} failed: {exc}") from None
            if got == 0:
                raise PeerClosed(f"the {self.peer} closed the connection")
            self._end += got

    def _take(self, n: int) -> int:
        """Consume ``n`` bytes and return their offset in the buffer."""
        if self._end - self._start < n:
            self._fill(n)
        offset = self._start
        self._start += n
        return offset

    def read_bytes(self, n: int) -> bytes:
        """Exactly ``n`` bytes."""
        offset = self._take(n)
        return self._buf[offset : offset + n].tobytes()

    def read_int32(self) -> int:
        return _INT32.unpack_from(self._buf, self._take(4))[0]  # type: ignore[arg-type]  # ndarray is a buffer; numpy types __buffer__ for 3.12+ only

    def read_struct(self, layout: struct.Struct) -> tuple[Any, ...]:
        """One fixed-size record, unpacked."""
        return layout.unpack_from(self._buf, self._take(layout.size))  # type: ignore[arg-type]  # ndarray is a buffer; numpy types __buffer__ for 3.12+ only

    def read_float64s(self, count: int, scale: float | None = None) -> np.ndarray:
        """``count`` float64 values (times ``scale``) as a fresh array, never a view."""
        offset = self._take(8 * count)
        values = np.frombuffer(self._buf, dtype=np.float64, count=count, offset=offset)
        # Scaling already makes the copy the buffer's reuse requires.
        return values.copy() if scale is None else values * scale

    def read_header(self) -> str:
        """The next header word; unknown or non-ASCII headers raise ProtocolError."""
        offset = self._take(HEADER_LEN)
        raw = self._buf[offset : offset + HEADER_LEN].tobytes()
        word = _WORDS.get(raw)
        if word is None:
            raise ProtocolError(f"unknown header {raw!r} from the {self.peer}")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("recv %s from %s", word, self.peer)
        return word

    # writes ---------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Write one whole message with ``sendall``, within the current deadline."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "send %s (%d bytes) to %s", bytes(data[:HEADER_LEN]).rstrip(), len(data), self.peer
            )
        remaining = None
        if self._deadline is not None:
            remaining = max(self._deadline - time.monotonic(), 0.001)
        # sendall under a slice timeout could stop half-way with no way to resume,
        # so writes get the whole remaining budget instead.
        self.sock.settimeout(remaining)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise FrameTimeout(f"the {self.peer} did not read within {self._timeout:g} s") from None
        except ConnectionError as exc:
            raise PeerClosed(f"the {self.peer} closed the connection ({exc})") from None
        except OSError as exc:
            raise ProtocolError(f"writing to the {self.peer} failed: {exc}") from None
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(self.slice_s)


# --- message readers ------------------------------------------------------------------


def _read_natoms(stream: FrameStream, what: str) -> int:
    natoms = stream.read_int32()
    if natoms < 1 or natoms > MAX_ATOMS:
        raise ProtocolError(f"{what} declares {natoms} atoms (allowed: 1..{MAX_ATOMS})")
    return natoms


def read_length(stream: FrameStream, what: str) -> int:
    length = stream.read_int32()
    if length < 0 or length > MAX_PAYLOAD:
        raise ProtocolError(f"{what} declares {length} bytes (allowed: 0..{MAX_PAYLOAD})")
    return length


def read_posdata_body(stream: FrameStream) -> PosData:
    """The body of a ``POSDATA`` frame (after its header)."""
    h = stream.read_float64s(9, BOHR).reshape(3, 3)
    stream.read_bytes(72)  # h^-1: the worker derives what it needs from h
    natoms = _read_natoms(stream, "POSDATA")
    positions = stream.read_float64s(3 * natoms, BOHR).reshape(natoms, 3)
    return PosData(cell=h.T, positions=positions)


def read_init_body(stream: FrameStream) -> Init:
    """The body of an ``INIT`` frame (after its header)."""
    bead = stream.read_int32()
    length = read_length(stream, "INIT")
    return Init(bead=bead, payload=stream.read_bytes(length))


def read_forceready_body(stream: FrameStream, natoms: int | None = None) -> ForceReply:
    """The body of a ``FORCEREADY`` frame; ``natoms`` is the count the reply must have."""
    energy, count = stream.read_struct(_F64_INT32)
    if count < 0 or count > MAX_ATOMS:
        raise ProtocolError(f"FORCEREADY declares {count} atoms")
    if natoms is not None and count != natoms:
        raise ProtocolError(f"FORCEREADY carries {count} atoms but {natoms} were sent")
    forces = stream.read_float64s(3 * count, HARTREE / BOHR).reshape(count, 3)
    virial = stream.read_float64s(9, HARTREE).reshape(3, 3).T
    extra = stream.read_bytes(read_length(stream, "FORCEREADY extra"))
    return ForceReply(energy=energy * HARTREE, forces=forces, virial=virial, extra=extra)


def read_error_body(stream: FrameStream) -> ErrorReply:
    """The body of an ``ERROR`` frame (rootstock dialect)."""
    data = _loads(stream.read_bytes(read_length(stream, "ERROR")), "ERROR")
    if not isinstance(data, dict):
        raise ProtocolError("ERROR payload is not a JSON object")
    known = {"type", "message", "traceback", "phase"}
    return ErrorReply(
        type=str(data.get("type", "Exception")),
        message=str(data.get("message", "")),
        traceback=str(data.get("traceback", "")),
        phase=str(data.get("phase", "calculate")),
        details={k: v for k, v in data.items() if k not in known},
    )


def read_reply(stream: FrameStream, natoms: int | None = None) -> ForceReply | ErrorReply:
    """The worker's answer to ``GETFORCE``: FORCEREADY or (dialect) ERROR."""
    word = stream.read_header()
    if word == "FORCEREADY":
        return read_forceready_body(stream, natoms)
    if word == "ERROR":
        return read_error_body(stream)
    raise ProtocolError(f"expected FORCEREADY or ERROR from the {stream.peer}, got {word}")
