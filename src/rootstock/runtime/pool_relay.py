"""Whole frames as raw bytes, for the pool daemon that relays them.

The daemon forwards what clients send and what the worker answers byte for byte,
so it reads each frame's length from its own fields and never decodes a body:

* from a client: ``INIT`` (int32 bead, int32 length, bytes), ``POSDATA`` (9+9
  float64, int32 natoms, 3*natoms float64), ``GETFORCE``, ``STATUS``, ``EXIT`` and
  rootstock's ``BATCH`` (int32 length, bytes);
* from the worker: ``FORCEREADY`` (float64, int32 natoms, 3*natoms float64, 9
  float64, int32 length, bytes), ``ERROR`` and ``BATCHREADY`` (int32 length, bytes).

Every length is checked against the protocol's caps first, so a corrupt field
cannot become a huge allocation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rootstock.errors import ProtocolError
from rootstock.runtime.protocol import (
    ERROR,
    EXIT,
    FORCEREADY,
    GETFORCE,
    HEADER_LEN,
    INIT,
    MAX_ATOMS,
    MAX_PAYLOAD,
    POSDATA,
    STATUS,
    FrameStream,
)

# Spelled here too so the relay does not depend on which frames protocol.py decodes.
BATCH = b"BATCH".ljust(HEADER_LEN)
BATCHREADY = b"BATCHREADY".ljust(HEADER_LEN)

_INT32 = struct.Struct("=i")
_INIT_HEAD = struct.Struct("=ii")
_F64_INT32 = struct.Struct("=di")
_CELLS = 18 * 8  # h and h^-1
_VIRIAL = 9 * 8


@dataclass(frozen=True)
class RawFrame:
    """One frame: its 12-byte header and all of its bytes (header included)."""

    header: bytes
    data: bytes

    @property
    def word(self) -> str:
        return self.header.rstrip().decode("ascii", "replace")


def _length(stream: FrameStream, what: str) -> bytes:
    raw = stream.read_bytes(4)
    (length,) = _INT32.unpack(raw)
    if length < 0 or length > MAX_PAYLOAD:
        raise ProtocolError(f"{what} declares {length} bytes (allowed: 0..{MAX_PAYLOAD})")
    return raw + stream.read_bytes(length)


def _natoms(raw: bytes, offset: int, what: str) -> int:
    (natoms,) = _INT32.unpack_from(raw, offset)
    if natoms < 0 or natoms > MAX_ATOMS:
        raise ProtocolError(f"{what} declares {natoms} atoms (allowed: 0..{MAX_ATOMS})")
    return natoms


def read_client_frame(stream: FrameStream) -> RawFrame:
    """The next whole frame a client sends; anything a client may not send raises."""
    header = stream.read_bytes(HEADER_LEN)
    if header in (GETFORCE, STATUS, EXIT):
        return RawFrame(header, header)
    if header == INIT:
        head = stream.read_bytes(_INIT_HEAD.size)
        _bead, length = _INIT_HEAD.unpack(head)
        if length < 0 or length > MAX_PAYLOAD:
            raise ProtocolError(f"INIT declares {length} bytes (allowed: 0..{MAX_PAYLOAD})")
        return RawFrame(header, header + head + stream.read_bytes(length))
    if header == POSDATA:
        head = stream.read_bytes(_CELLS + 4)
        natoms = _natoms(head, _CELLS, "POSDATA")
        if natoms < 1:
            raise ProtocolError("POSDATA declares no atoms")
        return RawFrame(header, header + head + stream.read_bytes(24 * natoms))
    if header == BATCH:
        return RawFrame(header, header + _length(stream, "BATCH"))
    raise ProtocolError(f"a pool client sent {header!r}, which the pool does not relay")


def read_worker_reply(stream: FrameStream) -> RawFrame:
    """The worker's whole answer to GETFORCE or BATCH: FORCEREADY, ERROR or BATCHREADY."""
    header = stream.read_bytes(HEADER_LEN)
    if header == FORCEREADY:
        head = stream.read_bytes(_F64_INT32.size)
        natoms = _natoms(head, 8, "FORCEREADY")
        body = stream.read_bytes(24 * natoms + _VIRIAL)
        return RawFrame(header, header + head + body + _length(stream, "FORCEREADY extra"))
    if header == ERROR:
        return RawFrame(header, header + _length(stream, "ERROR"))
    if header == BATCHREADY:
        return RawFrame(header, header + _length(stream, "BATCHREADY"))
    raise ProtocolError(f"the worker answered with {header!r}, not a reply")


def error_payload(frame: RawFrame) -> bytes:
    """The JSON bytes of a raw ERROR frame."""
    return frame.data[HEADER_LEN + 4 :]
