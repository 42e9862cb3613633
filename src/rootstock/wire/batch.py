"""The bodies of rootstock's batch frames, ``BATCH`` and ``BATCHREADY``.

Both frames are "12-byte header, int32 length L, L body bytes", so a proxy can
forward them knowing nothing more. Inside a body: two int32 (the item count and
the length of a JSON part), the JSON part (UTF-8, padded with spaces to a multiple
of 8 bytes so the float64 blocks after it stay aligned), then binary blocks.
Units are Å and eV, not bohr and hartree: nothing here is seen by i-PI.
The exact layout is in docs/protocol.md ("Batch frames").

This module needs only the standard library and numpy: the worker imports it
inside every model env.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rootstock.errors import ProtocolError
from rootstock.wire.framing import (
    BATCH,
    BATCHREADY,
    EXTRA_PROPERTIES,
    MAX_ATOMS,
    MAX_PAYLOAD,
    ErrorReply,
    FrameStream,
    extra_array,
    read_error_body,
)

#: Property names a BATCH may ask for (``free_energy`` comes with ``energy``).
BATCH_PROPERTIES = ("energy", "forces", "stress", *EXTRA_PROPERTIES)
#: Per-atom arrays a BATCH forwards from the client's atoms, as INIT does.
FORWARDED_ARRAYS = ("initial_magmoms", "initial_charges")
# Atomic numbers ASE knows (0 is its dummy "X").
MAX_ATOMIC_NUMBER = 118

# BATCHREADY per-item flags.
FLAG_OK = 1
FLAG_FORCES = 2
FLAG_VIRIAL = 4

_HEAD = struct.Struct("=ii")
_INT32 = struct.Struct("=i")
_PBC_BITS = np.array([1, 2, 4], dtype=np.int32)


@dataclass(frozen=True)
class BatchItem:
    """One structure of a BATCH: what INIT and POSDATA carry for a single call, in Å."""

    numbers: np.ndarray
    pbc: np.ndarray
    cell: np.ndarray
    positions: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def natoms(self) -> int:
        return len(self.numbers)


@dataclass(frozen=True)
class MemoryLimit:
    """How much memory the model calls of one BATCH may add to the worker's footprint.

    ``fraction`` (0 < f <= 1) of the device's total memory, or ``nbytes``; neither
    is the worker's default (half the free GPU memory, a quarter of the available
    RAM). Sent as the BATCH JSON field ``memory``; its absence means what a BATCH
    meant before the field existed: the whole chunk in one model call.
    """

    fraction: float | None = None
    nbytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``memory`` field: ``{}``, ``{"fraction": f}`` or ``{"bytes": n}``."""
        if self.fraction is not None:
            return {"fraction": self.fraction}
        if self.nbytes is not None:
            return {"bytes": self.nbytes}
        return {}


@dataclass(frozen=True)
class BatchRequest:
    """A decoded BATCH: the structures, the properties asked for, the NaN policy, and
    the memory bound the worker sizes its model calls by (None: one call per chunk)."""

    items: list[BatchItem]
    properties: tuple[str, ...]
    allow_nonfinite: bool = False
    memory: MemoryLimit | None = None


@dataclass
class ItemResult:
    """One structure's results in eV, eV/Å and eV (virial ``-V·σ``, 3x3).

    ``free_energy`` is None when it equals the energy; ``forces`` and ``virial``
    are None when they were not asked for (or, for the virial, not 3-D periodic).
    """

    energy: float
    forces: np.ndarray | None = None
    virial: np.ndarray | None = None
    free_energy: float | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ItemError:
    """One structure that failed in the worker: the exception's type, text and traceback."""

    type: str
    message: str
    traceback: str = ""


@dataclass
class BatchReply:
    """A decoded BATCHREADY: one result or error per item, in order, the model report,
    and the memory report (only when the BATCH asked the worker to size by memory)."""

    results: list[ItemResult | ItemError]
    model: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None


# --- shared helpers -------------------------------------------------------------------


def _json_part(doc: dict[str, Any]) -> bytes:
    # NaN and inf (allow_nonfinite, or in atoms.info) travel as JSON's NaN/Infinity
    # tokens, which Python reads back, as INIT does.
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def _frame(header: bytes, count: int, doc: dict[str, Any], blocks: Sequence[Any]) -> bytes:
    """Header, body length, and the body: count, JSON length, JSON, blocks."""
    head = _json_part(doc)
    size = _HEAD.size + len(head) + sum(memoryview(b).nbytes for b in blocks)
    if size > MAX_PAYLOAD:
        raise ValueError(f"a {header.rstrip().decode()} body of {size} bytes exceeds {MAX_PAYLOAD}")
    return b"".join((header, _INT32.pack(size), _HEAD.pack(count, len(head)), head, *blocks))


class _Reader:
    """Walks a body, checking every length before it is used."""

    def __init__(self, body: bytes, what: str) -> None:
        self.body = body
        self.what = what
        self.offset = 0

    def take(self, nbytes: int, block: str) -> int:
        start = self.offset
        if nbytes < 0 or start + nbytes > len(self.body):
            raise ProtocolError(
                f"{self.what} body is too short: {block} needs {nbytes} bytes at offset "
                f"{start}, {len(self.body) - start} left"
            )
        self.offset += nbytes
        return start

    def array(self, dtype: type, count: int, block: str) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        start = self.take(size * count, block)
        return np.frombuffer(self.body, dtype=dtype, count=count, offset=start).copy()

    def head(self) -> tuple[int, dict[str, Any]]:
        start = self.take(_HEAD.size, "the header")
        count, json_len = _HEAD.unpack_from(self.body, start)
        if count < 1 or count > MAX_ATOMS:
            raise ProtocolError(f"{self.what} declares {count} items (allowed: 1..{MAX_ATOMS})")
        if json_len < 2:
            raise ProtocolError(f"{self.what} declares a JSON part of {json_len} bytes")
        raw = self.body[self.take(json_len, "the JSON part") : self.offset]
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"{self.what} JSON part is not valid UTF-8 JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ProtocolError(f"{self.what} JSON part is not a JSON object")
        return count, doc

    def natoms(self, count: int) -> np.ndarray:
        natoms = self.array(np.int32, count, "the atom counts")
        if count and (natoms.min() < 1 or natoms.max() > MAX_ATOMS):
            raise ProtocolError(f"{self.what} holds an atom count outside 1..{MAX_ATOMS}")
        if int(natoms.sum(dtype=np.int64)) > MAX_ATOMS:
            raise ProtocolError(f"{self.what} holds more than {MAX_ATOMS} atoms in all")
        return natoms

    def finish(self) -> None:
        if self.offset != len(self.body):
            raise ProtocolError(
                f"{self.what} body has {len(self.body) - self.offset} bytes after its last block"
            )


def _index_map(doc: dict[str, Any], key: str, count: int, what: str) -> dict[int, Any]:
    """A JSON object keyed by item indices ("0", "1", ...), checked."""
    raw = doc.get(key, {})
    if not isinstance(raw, dict):
        raise ProtocolError(f"{what} field {key!r} is not a JSON object")
    out: dict[int, Any] = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < count):
            raise ProtocolError(f"{what} field {key!r} has a key {k!r} that is not an item index")
        out[int(k)] = v
    return out


# --- BATCH ----------------------------------------------------------------------------


def encode_batch(request: BatchRequest) -> bytes:
    """The whole BATCH frame (header, length, body) for ``request``.

    Raises ValueError for an empty request, an unknown property, or a body over
    MAX_PAYLOAD; the client never builds such a chunk.
    """
    items = request.items
    if not items:
        raise ValueError("a BATCH needs at least one structure")
    unknown = [p for p in request.properties if p not in BATCH_PROPERTIES]
    if unknown:
        raise ValueError(f"unknown batch properties {unknown}")
    doc: dict[str, Any] = {"properties": list(request.properties)}
    if request.allow_nonfinite:
        doc["allow_nonfinite"] = True
    infos = {str(i): item.info for i, item in enumerate(items) if item.info}
    if infos:
        doc["info"] = infos
    arrays = {
        str(i): {name: np.asarray(a, dtype=np.float64).tolist() for name, a in item.arrays.items()}
        for i, item in enumerate(items)
        if item.arrays
    }
    if arrays:
        doc["arrays"] = arrays
    if request.memory is not None:
        doc["memory"] = request.memory.to_json()
    natoms = np.array([item.natoms for item in items], dtype=np.int32)
    pbc = np.array([np.asarray(item.pbc, dtype=bool) for item in items], dtype=np.int32) @ _PBC_BITS
    cells = np.concatenate([np.asarray(item.cell, dtype=np.float64).reshape(9) for item in items])
    positions = np.concatenate(
        [np.asarray(item.positions, dtype=np.float64).reshape(-1) for item in items]
    )
    numbers = np.concatenate([np.asarray(item.numbers, dtype=np.int32) for item in items])
    return _frame(
        BATCH,
        len(items),
        doc,
        [natoms.astype(np.int32), pbc.astype(np.int32), cells, positions, numbers],
    )


def decode_batch_body(body: bytes) -> BatchRequest:
    """A BATCH body (after header and length) as a :class:`BatchRequest`; ProtocolError
    for anything that breaks the layout."""
    reader = _Reader(body, "BATCH")
    count, doc = reader.head()
    properties = doc.get("properties")
    if not isinstance(properties, list) or not all(p in BATCH_PROPERTIES for p in properties):
        raise ProtocolError(
            f"BATCH properties must be a list of {', '.join(BATCH_PROPERTIES)}; got {properties!r}"
        )
    allow_nonfinite = doc.get("allow_nonfinite", False)
    if not isinstance(allow_nonfinite, bool):
        raise ProtocolError("BATCH allow_nonfinite must be true or false")
    natoms = reader.natoms(count)
    pbc_mask = reader.array(np.int32, count, "the PBC flags")
    if count and (pbc_mask.min() < 0 or pbc_mask.max() > 7):
        raise ProtocolError("BATCH holds a PBC mask outside 0..7")
    total = int(natoms.sum())
    cells = reader.array(np.float64, 9 * count, "the cells").reshape(count, 3, 3)
    positions = reader.array(np.float64, 3 * total, "the positions").reshape(total, 3)
    numbers = reader.array(np.int32, total, "the atomic numbers")
    reader.finish()
    if total and (numbers.min() < 0 or numbers.max() > MAX_ATOMIC_NUMBER):
        raise ProtocolError(f"BATCH holds an atomic number outside 0..{MAX_ATOMIC_NUMBER}")
    infos = _index_map(doc, "info", count, "BATCH")
    arrays = _index_map(doc, "arrays", count, "BATCH")
    memory = _memory_limit(doc.get("memory"))
    bounds = np.concatenate(([0], np.cumsum(natoms)))
    items = []
    for i in range(count):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        info = infos.get(i, {})
        if not isinstance(info, dict):
            raise ProtocolError(f"BATCH info of item {i} is not a JSON object")
        items.append(
            BatchItem(
                numbers=numbers[lo:hi],
                pbc=(int(pbc_mask[i]) & _PBC_BITS) != 0,
                cell=cells[i],
                positions=positions[lo:hi],
                info=info,
                arrays=_item_arrays(arrays.get(i, {}), hi - lo, i),
            )
        )
    return BatchRequest(items, tuple(properties), allow_nonfinite, memory)


def _memory_limit(raw: Any) -> MemoryLimit | None:
    """The BATCH ``memory`` field; keys this reader does not know are ignored, so a
    later client may add one."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError(f"BATCH memory is not a JSON object: {str(raw)[:200]}")
    fraction, nbytes = raw.get("fraction"), raw.get("bytes")
    if fraction is not None and nbytes is not None:
        raise ProtocolError("BATCH memory gives both a fraction and bytes")
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ProtocolError(f"BATCH memory fraction is not a number: {fraction!r}")
        if not 0 < fraction <= 1:
            raise ProtocolError(f"BATCH memory fraction {fraction!r} is outside (0, 1]")
        return MemoryLimit(fraction=float(fraction))
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ProtocolError(f"BATCH memory bytes must be a positive integer: {nbytes!r}")
        return MemoryLimit(nbytes=nbytes)
    return MemoryLimit()


def _item_arrays(raw: Any, natoms: int, index: int) -> dict[str, np.ndarray]:
    if not isinstance(raw, dict):
        raise ProtocolError(f"BATCH arrays of item {index} is not a JSON object")
    out = {}
    for name, values in raw.items():
        if name not in FORWARDED_ARRAYS:
            raise ProtocolError(f"BATCH item {index} forwards an unknown array {name!r}")
        try:
            array = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):
            raise ProtocolError(f"BATCH array {name!r} of item {index} is not numeric") from None
        if array.ndim == 0 or array.shape[0] != natoms or array.ndim > 2:
            raise ProtocolError(
                f"BATCH array {name!r} of item {index} has shape {array.shape} for {natoms} atoms"
            )
        out[name] = array
    return out


# --- BATCHREADY -----------------------------------------------------------------------


def encode_batchready(reply: BatchReply, natoms: Sequence[int]) -> bytes:
    """The whole BATCHREADY frame for ``reply``; ``natoms`` are the request's atom counts.

    Raises ValueError when an array does not have the shape its item needs (the
    worker checks results first, so this is a last guard against a body that would
    put the reader out of step) or when the body would exceed MAX_PAYLOAD.
    """
    if len(reply.results) != len(natoms):
        raise ValueError(f"{len(reply.results)} results for {len(natoms)} items")
    flags = np.zeros(len(natoms), dtype=np.int32)
    energies = np.zeros(len(natoms), dtype=np.float64)
    forces: list[np.ndarray] = []
    virials: list[np.ndarray] = []
    extra_values: list[np.ndarray] = []
    errors: list[dict[str, Any]] = []
    free: dict[str, float] = {}
    extras: list[dict[str, Any]] = []
    for i, (result, n) in enumerate(zip(reply.results, natoms, strict=True)):
        if isinstance(result, ItemError):
            errors.append(
                {"index": i, "type": result.type, "message": result.message,
                 "traceback": result.traceback}
            )  # fmt: skip
            continue
        flags[i] = FLAG_OK
        energies[i] = result.energy
        if result.forces is not None:
            f = np.asarray(result.forces, dtype=np.float64)
            if f.shape != (n, 3):
                raise ValueError(f"item {i}: forces of shape {f.shape} for {n} atoms")
            flags[i] |= FLAG_FORCES
            forces.append(f.reshape(-1))
        if result.virial is not None:
            v = np.asarray(result.virial, dtype=np.float64)
            if v.shape != (3, 3):
                raise ValueError(f"item {i}: a virial of shape {v.shape}")
            flags[i] |= FLAG_VIRIAL
            virials.append(v.reshape(-1))
        if result.free_energy is not None:
            free[str(i)] = float(result.free_energy)
        for name, value in result.extras.items():
            array = extra_array(name, value, n)
            extras.append({"index": i, "name": name, "shape": list(array.shape)})
            extra_values.append(array.reshape(-1))
    doc: dict[str, Any] = {"errors": errors, "free_energy": free, "extras": extras}
    if reply.model is not None:
        doc["model"] = reply.model
    if reply.memory is not None:
        doc["memory"] = reply.memory
    blocks = [
        np.asarray(natoms, dtype=np.int32),
        flags,
        energies,
        *(np.concatenate(b) for b in (forces, virials, extra_values) if b),
    ]
    return _frame(BATCHREADY, len(natoms), doc, blocks)


def _float_of(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"BATCHREADY {what} is not a number: {value!r}")
    return float(value)


def decode_batchready_body(body: bytes, natoms: Sequence[int] | None = None) -> BatchReply:
    """A BATCHREADY body as a :class:`BatchReply`; ``natoms``, when given, are the atom
    counts that were sent, which the reply must echo."""
    reader = _Reader(body, "BATCHREADY")
    count, doc = reader.head()
    got = reader.natoms(count)
    if natoms is not None and (len(natoms) != count or not np.array_equal(got, natoms)):
        raise ProtocolError(
            f"BATCHREADY answers {count} items of {got.tolist()[:8]} atoms, but "
            f"{len(natoms)} items of {list(natoms)[:8]} atoms were sent"
        )
    flags = reader.array(np.int32, count, "the flags")
    if count and (flags.min() < 0 or flags.max() > 7):
        raise ProtocolError("BATCHREADY holds an unknown item flag")
    energies = reader.array(np.float64, count, "the energies")
    with_forces = (flags & FLAG_FORCES) != 0
    force_atoms = int(got[with_forces].sum())
    forces = reader.array(np.float64, 3 * force_atoms, "the forces")
    with_virial = (flags & FLAG_VIRIAL) != 0
    virials = reader.array(np.float64, 9 * int(with_virial.sum()), "the virials").reshape(-1, 3, 3)
    extras = doc.get("extras", [])
    if not isinstance(extras, list):
        raise ProtocolError("BATCHREADY extras is not a JSON list")
    sizes = []
    for entry in extras:
        if not (
            isinstance(entry, dict)
            and entry.get("name") in EXTRA_PROPERTIES
            and isinstance(entry.get("index"), int)
            and 0 <= entry["index"] < count
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and 0 <= d <= MAX_ATOMS for d in entry["shape"])
        ):
            raise ProtocolError(f"BATCHREADY has a malformed extras entry: {str(entry)[:200]}")
        sizes.append(int(np.prod(entry["shape"], dtype=np.int64)))
    if sum(sizes) > MAX_PAYLOAD:
        raise ProtocolError("BATCHREADY declares more extra values than a body holds")
    values = reader.array(np.float64, sum(sizes), "the extras")
    reader.finish()
    results: list[ItemResult | ItemError | None] = [None] * count
    for entry in _error_entries(doc, count):
        if flags[entry["index"]] & FLAG_OK:
            raise ProtocolError(f"BATCHREADY item {entry['index']} has both a result and an error")
        results[entry["index"]] = ItemError(
            entry["type"], entry["message"], entry.get("traceback", "")
        )
    force_at = np.concatenate(([0], np.cumsum(np.where(with_forces, got, 0)) * 3))
    virial_at = np.concatenate(([0], np.cumsum(with_virial)))
    for i in range(count):
        if not flags[i] & FLAG_OK:
            if results[i] is None:
                raise ProtocolError(f"BATCHREADY item {i} has neither a result nor an error")
            continue
        results[i] = ItemResult(
            energy=float(energies[i]),
            forces=forces[force_at[i] : force_at[i + 1]].reshape(-1, 3) if with_forces[i] else None,
            virial=virials[virial_at[i]] if with_virial[i] else None,
        )
    free = _index_map(doc, "free_energy", count, "BATCHREADY")
    offset = 0
    for entry, size in zip(extras, sizes, strict=True):
        result = results[entry["index"]]
        chunk = values[offset : offset + size].reshape(entry["shape"])
        offset += size
        if not isinstance(result, ItemResult):
            raise ProtocolError(f"BATCHREADY sends extras for failed item {entry['index']}")
        try:
            result.extras[entry["name"]] = extra_array(
                entry["name"], chunk, int(got[entry["index"]])
            )
        except ValueError as exc:
            raise ProtocolError(f"BATCHREADY item {entry['index']}: {exc}") from None
    for index, value in free.items():
        result = results[index]
        if not isinstance(result, ItemResult):
            raise ProtocolError(f"BATCHREADY sends a free energy for failed item {index}")
        result.free_energy = _float_of(value, "free_energy")
    model = doc.get("model")
    if model is not None and not isinstance(model, dict):
        raise ProtocolError("BATCHREADY model report is not a JSON object")
    memory = doc.get("memory")
    if memory is not None and not isinstance(memory, dict):
        raise ProtocolError("BATCHREADY memory report is not a JSON object")
    return BatchReply([r for r in results if r is not None], model, memory)


def _error_entries(doc: dict[str, Any], count: int) -> list[dict[str, Any]]:
    errors = doc.get("errors", [])
    if not isinstance(errors, list):
        raise ProtocolError("BATCHREADY errors is not a JSON list")
    for entry in errors:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("index"), int)
            and 0 <= entry["index"] < count
            and isinstance(entry.get("type"), str)
            and isinstance(entry.get("message"), str)
            and isinstance(entry.get("traceback", ""), str)
        ):
            raise ProtocolError(f"BATCHREADY has a malformed error entry: {str(entry)[:200]}")
    return errors


def read_batch_reply(
    stream: FrameStream, natoms: Sequence[int] | None = None
) -> BatchReply | ErrorReply:
    """The worker's answer to ``BATCH``: BATCHREADY (checked against the ``natoms`` sent)
    or ERROR, when the request failed as a whole."""
    word = stream.read_header()
    if word == "BATCHREADY":
        length = stream.read_int32()
        if length < 0 or length > MAX_PAYLOAD:
            raise ProtocolError(f"BATCHREADY declares {length} bytes (allowed: 0..{MAX_PAYLOAD})")
        return decode_batchready_body(stream.read_bytes(length), natoms)
    if word == "ERROR":
        return read_error_body(stream)
    raise ProtocolError(f"expected BATCHREADY or ERROR from the {stream.peer}, got {word}")
