"""Whole frames as raw bytes, for the pool daemon that relays them.

The daemon forwards what clients send and what the worker answers byte for byte,
so it reads each frame's length from its own fields and never decodes a body:

* from a client: ``INIT`` (int32 bead, int32 length, bytes), ``POSDATA`` (9+9
  float64, int32 natoms, 3*natoms float64), ``GETFORCE``, ``STATUS``, ``EXIT``,
  rootstock's ``BATCH`` (int32 length, bytes) and the pool's own ``RSDEADLINE``
  (float64 seconds: the caller's timeout for its next request; 0 for none);
* from the worker: ``FORCEREADY`` (float64, int32 natoms, 3*natoms float64, 9
  float64, int32 length, bytes), ``ERROR`` and ``BATCHREADY`` (int32 length, bytes).

Every length is checked against the protocol's caps first, so a corrupt field
cannot become a huge allocation, and a worker's reply is checked against the
request it answers (:class:`ReplyBound`), so a reply that declares more than the
request can produce is refused before the daemon waits for its bytes.

What a client sends is checked before it reaches the shared worker
(:func:`check_init`, :func:`batch_problem`): a frame the worker would choke on
fails that client alone.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from rootstock.errors import ProtocolError
from rootstock.wire.batch import decode_batch_body
from rootstock.wire.framing import (
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
    Init,
)

# Spelled here too so the relay does not depend on which frames protocol.py decodes.
BATCH = b"BATCH".ljust(HEADER_LEN)
BATCHREADY = b"BATCHREADY".ljust(HEADER_LEN)
# Pool-only: the caller's timeout for its next request, so the daemon can stop a
# worker that overruns it (a client sends it only to a daemon whose state file
# says ``relay`` >= RELAY_VERSION).
DEADLINE = b"RSDEADLINE".ljust(HEADER_LEN)
RELAY_VERSION = 2
# Nesting deeper than this in a client's INIT is refused before the worker parses it.
MAX_INIT_DEPTH = 64

_INT32 = struct.Struct("=i")
_INIT_HEAD = struct.Struct("=ii")
_F64_INT32 = struct.Struct("=di")
_CELLS = 18 * 8  # h and h^-1
_VIRIAL = 9 * 8
_F64 = struct.Struct("=d")
# What a worker may add to a reply beyond its fixed blocks: JSON extras (per-atom
# values and the model report), error texts and tracebacks. Generous: the bound is
# there to refuse a reply that declares millions of atoms for a 4-atom request.
_SLACK_BYTES = 4 << 20
_SLACK_PER_ITEM = 64 << 10
_SLACK_PER_ATOM = 1 << 10


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


@dataclass(frozen=True)
class ReplyBound:
    """What the reply to one request may hold: for ``GETFORCE``, exactly ``natoms``
    atoms; for ``BATCH``, ``items`` structures of ``atoms`` atoms in all."""

    natoms: int | None = None
    items: int = 1
    atoms: int = 0

    def max_length(self) -> int:
        atoms = self.natoms if self.natoms is not None else self.atoms
        slack = _SLACK_BYTES + _SLACK_PER_ITEM * self.items + _SLACK_PER_ATOM * atoms
        return min(MAX_PAYLOAD, slack + 8 * (16 * self.items + 12 * atoms))


def encode_deadline(seconds: float | None) -> bytes:
    """The pool's ``RSDEADLINE`` frame for a caller's timeout (None: no limit)."""
    return DEADLINE + _F64.pack(0.0 if seconds is None else float(seconds))


def deadline_seconds(frame: RawFrame) -> float | None:
    """The timeout a ``RSDEADLINE`` frame carries; None for no limit."""
    (seconds,) = _F64.unpack_from(frame.data, HEADER_LEN)
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    return seconds


def read_client_frame(stream: FrameStream) -> RawFrame:
    """The next whole frame a client sends; anything a client may not send raises."""
    header = stream.read_bytes(HEADER_LEN)
    if header in (GETFORCE, STATUS, EXIT):
        return RawFrame(header, header)
    if header == DEADLINE:
        return RawFrame(header, header + stream.read_bytes(_F64.size))
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


def _bounded_length(stream: FrameStream, what: str, limit: int) -> bytes:
    raw = stream.read_bytes(4)
    (length,) = _INT32.unpack(raw)
    if length < 0 or length > limit:
        raise ProtocolError(
            f"{what} declares {length} bytes (allowed for this request: 0..{limit})"
        )
    return raw + stream.read_bytes(length)


def read_worker_reply(stream: FrameStream, bound: ReplyBound) -> RawFrame:
    """The worker's whole answer to GETFORCE or BATCH: FORCEREADY, ERROR or BATCHREADY.

    A reply larger than ``bound`` allows, or of the wrong kind for the request,
    raises ProtocolError before its body is waited for.
    """
    header = stream.read_bytes(HEADER_LEN)
    limit = bound.max_length()
    if header == FORCEREADY:
        if bound.natoms is None:
            raise ProtocolError("the worker answered a BATCH with FORCEREADY")
        head = stream.read_bytes(_F64_INT32.size)
        natoms = _natoms(head, 8, "FORCEREADY")
        if natoms != bound.natoms:
            raise ProtocolError(
                f"the worker's FORCEREADY declares {natoms} atoms, but the request had "
                f"{bound.natoms}"
            )
        body = stream.read_bytes(24 * natoms + _VIRIAL)
        extra = _bounded_length(stream, "FORCEREADY extra", limit)
        return RawFrame(header, header + head + body + extra)
    if header == ERROR:
        return RawFrame(header, header + _length(stream, "ERROR"))
    if header == BATCHREADY:
        if bound.natoms is not None:
            raise ProtocolError("the worker answered GETFORCE with BATCHREADY")
        return RawFrame(header, header + _bounded_length(stream, "BATCHREADY", limit))
    raise ProtocolError(f"the worker answered with {header!r}, not a reply")


def _depth_exceeds(value: object, limit: int) -> bool:
    """True if ``value`` nests lists and objects deeper than ``limit`` (no recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


@dataclass(frozen=True)
class InitCheck:
    """What the daemon makes of a client's ``INIT``: why it is refused (None: it is
    not), and whether that system's single calls may be merged with other clients'
    (it asks for no extras, which the ``evaluate_batch`` hook does not return)."""

    problem: str | None
    mergeable: bool = False


def check_init(frame: RawFrame) -> InitCheck:
    """Whether a client's ``INIT`` may reach a shared worker, and be merged.

    A pooled worker is shared, so its clients must speak rootstock's dialect: a
    standard init string (which may switch i-PI batching on), invalid JSON, or
    JSON nested deeper than :data:`MAX_INIT_DEPTH` is refused here.
    """
    payload = frame.data[HEADER_LEN + _INIT_HEAD.size :]
    try:
        config = Init(0, payload).dialect_config()
    except ProtocolError as exc:
        return InitCheck(str(exc))
    if config is None:
        return InitCheck("a pool client's INIT must be rootstock's JSON system description")
    if _depth_exceeds(config, MAX_INIT_DEPTH):
        return InitCheck(f"the INIT JSON nests deeper than {MAX_INIT_DEPTH} levels")
    return InitCheck(None, mergeable=not config.get("extras"))


def forceready_model(frame: RawFrame) -> dict[str, Any] | None:
    """The model report in a raw ``FORCEREADY``'s extra JSON, or None when it has none
    (the daemon reads it to learn whether its worker takes ``RSMERGE``)."""
    if frame.header != FORCEREADY:
        return None
    (natoms,) = _INT32.unpack_from(frame.data, HEADER_LEN + 8)
    offset = HEADER_LEN + _F64_INT32.size + 24 * natoms + _VIRIAL
    (length,) = _INT32.unpack_from(frame.data, offset)
    if not length:
        return None
    try:
        extra = json.loads(frame.data[offset + 4 : offset + 4 + length])
    except ValueError:
        return None
    model = extra.get("model") if isinstance(extra, dict) else None
    return model if isinstance(model, dict) else None


def batch_problem(frame: RawFrame) -> tuple[str | None, ReplyBound]:
    """Why a client's ``BATCH`` must not reach the worker (None: it may), and the bound
    on the worker's reply to it."""
    body = frame.data[HEADER_LEN + 4 :]
    try:
        request = decode_batch_body(body)
    except ProtocolError as exc:
        return str(exc), ReplyBound(items=0)
    except (ValueError, TypeError, RecursionError) as exc:
        return f"malformed BATCH body: {exc}", ReplyBound(items=0)
    atoms = sum(item.natoms for item in request.items)
    return None, ReplyBound(items=len(request.items), atoms=atoms)


def posdata_natoms(data: bytes) -> int:
    """The atom count a raw ``POSDATA`` frame (its bytes, header included) declares."""
    (natoms,) = _INT32.unpack_from(data, HEADER_LEN + _CELLS)
    return int(natoms)


def error_payload(frame: RawFrame) -> bytes:
    """The JSON bytes of a raw ERROR frame."""
    return frame.data[HEADER_LEN + 4 :]
