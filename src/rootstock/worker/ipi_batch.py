"""i-PI's batched socket mode (i-PI >= 3.3), as ``rootstock serve`` speaks it.

A batch-aware i-PI announces its batch size N in the INIT string (a
``batch_size:N`` token among comma-separated parameters) and from then on every
exchange carries N structures that share one atom count:

* ``POSDATA``: int32 natoms, then N times (9 float64 ``h``, 9 float64 ``h^-1``),
  then N times 3*natoms float64 positions. A short batch is padded by repeating
  its last structure, whose results i-PI reads and drops.
* ``FORCEREADY``: N float64 energies, int32 natoms, N times 3*natoms float64
  forces, N times 9 float64 virials, then N times (int32 length, extra bytes).

Units and the per-structure conventions (``h`` with the lattice vectors as
columns, the virial transposed) are those of the single-structure frames, so a
batch of N is bit for bit N single calls. Only rootstock's own dialect has ``BATCH``;
nothing here is sent to a rootstock client.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rootstock.errors import ProtocolError
from rootstock.wire.batch import BatchRequest, decode_batch_body
from rootstock.wire.framing import (
    BOHR,
    FORCEREADY,
    HARTREE,
    MAX_ATOMS,
    FrameStream,
    Init,
    PosData,
    read_init_body,
    read_length,
    read_posdata_body,
)
from rootstock.worker.merge import MergeRequest, read_merge_body
from rootstock.worker.model import (
    ModelRunner,
    check_finite,
    checked_energy,
    checked_forces,
    checked_stress,
)

log = logging.getLogger("rootstock.worker")

#: The largest batch a server may announce: a corrupt INIT must not size buffers.
MAX_BATCH = 1 << 16

#: What a single calculation yields: energy (eV), forces (eV/Å), virial (eV), extra bytes.
Result = tuple[float, np.ndarray, np.ndarray, bytes]

_INT32 = struct.Struct("=i")
# The same products as protocol.encode_forceready, so batched replies match single ones.
_SCALE_FORCE = BOHR / HARTREE


@dataclass(frozen=True)
class BatchedPosData:
    """A batched ``POSDATA``: ``cells`` (N, 3, 3) ASE cells (rows) and ``positions``
    (N, natoms, 3), in Å."""

    cells: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return len(self.cells)


def init_batch_size(init: Init) -> int:
    """The batch size a standard INIT announces (its ``batch_size:N`` token), else 1.

    A token that is not a whole number in 1..MAX_BATCH raises ProtocolError: guessing
    would misread every POSDATA that follows.
    """
    text = init.payload.decode("utf-8", errors="replace")
    for token in text.split(","):
        key, sep, value = token.partition(":")
        if not sep or key.strip() != "batch_size":
            continue
        try:
            size = int(value.strip().rstrip("\0"))
        except ValueError:
            size = 0
        if not 1 <= size <= MAX_BATCH:
            raise ProtocolError(
                f"the server's INIT asks for batch_size {value.strip()!r}; "
                f"expected a whole number from 1 to {MAX_BATCH}"
            )
        return size
    return 1


def read_batched_posdata_body(stream: FrameStream, count: int) -> BatchedPosData:
    """The body of a batched ``POSDATA`` frame of ``count`` structures (after its header)."""
    natoms = stream.read_int32()
    if natoms < 1 or natoms * count > MAX_ATOMS:
        raise ProtocolError(
            f"a batched POSDATA declares {natoms} atoms for each of {count} structures "
            f"(allowed: 1 or more, at most {MAX_ATOMS} in all)"
        )
    # Each structure's h^-1 travels next to its h; the worker derives what it needs from h.
    h = stream.read_float64s(18 * count, BOHR).reshape(count, 2, 3, 3)[:, 0]
    positions = stream.read_float64s(3 * natoms * count, BOHR).reshape(count, natoms, 3)
    return BatchedPosData(cells=h.transpose(0, 2, 1), positions=positions)


def read_message(
    stream: FrameStream, body_timeout: float | None = None
) -> str | Init | PosData | BatchRequest | MergeRequest:
    """The next server-to-worker message: a word (STATUS, GETFORCE, EXIT), Init, PosData
    or (dialect) a :class:`~rootstock.wire.batch.BatchRequest`, or (the pool daemon's)
    a :class:`~rootstock.worker.merge.MergeRequest`.

    The header may take as long as the server likes (an idle worker waits); once it
    has arrived, the body must follow within ``body_timeout`` seconds. Replies
    (READY, FORCEREADY, ...) arriving at the worker are protocol errors. It lives
    here, beside the worker's loop, because only a worker reads a server's messages.
    """
    word = stream.read_header()
    if body_timeout is not None:
        stream.set_deadline(body_timeout)
    if word == "POSDATA":
        return read_posdata_body(stream)
    if word == "INIT":
        return read_init_body(stream)
    if word == "BATCH":
        return decode_batch_body(stream.read_bytes(read_length(stream, "BATCH")))
    if word == "RSMERGE":
        return read_merge_body(stream)
    if word in ("STATUS", "GETFORCE", "EXIT"):
        return word
    raise ProtocolError(f"the {stream.peer} sent {word}, which only a worker may send")


def read_server_message(
    stream: FrameStream, body_timeout: float | None, batch_size: int
) -> str | Init | PosData | BatchedPosData | BatchRequest | MergeRequest:
    """The next message from the server; with ``batch_size`` > 1 a POSDATA is batched.

    With a batch size of 1 this is :func:`read_message` (every frame, the
    dialect's included). A batching server is a standard i-PI server, so only the
    standard words are accepted from it.
    """
    if batch_size == 1:
        return read_message(stream, body_timeout)
    word = stream.read_header()
    if body_timeout is not None:
        stream.set_deadline(body_timeout)
    if word == "POSDATA":
        return read_batched_posdata_body(stream, batch_size)
    if word == "INIT":
        return read_init_body(stream)
    if word in ("STATUS", "GETFORCE", "EXIT"):
        return word
    raise ProtocolError(f"the {stream.peer} sent {word} during an i-PI batched exchange")


def encode_batched_forceready(results: Sequence[Result]) -> bytes:
    """A batched ``FORCEREADY`` frame in i-PI's layout from N single results.

    All structures must have the same atom count (one count travels on the wire);
    anything else raises ValueError rather than writing a frame i-PI would misread.
    """
    if not results:
        raise ValueError("a batched FORCEREADY needs at least one result")
    natoms = len(results[0][1])
    energies = np.empty(len(results), dtype=np.float64)
    forces = np.empty((len(results), natoms, 3), dtype=np.float64)
    virials = np.empty((len(results), 3, 3), dtype=np.float64)
    extras: list[bytes] = []
    for i, (energy, f, v, extra) in enumerate(results):
        f = np.asarray(f, dtype=np.float64)
        v = np.asarray(v, dtype=np.float64)
        if f.shape != (natoms, 3):
            raise ValueError(
                f"forces of shape {f.shape} in a batch of {natoms}-atom structures cannot be sent"
            )
        if v.shape != (3, 3):
            raise ValueError(f"a virial of shape {v.shape} cannot be sent; expected (3, 3)")
        energies[i] = float(energy) / HARTREE
        forces[i] = f * _SCALE_FORCE
        virials[i] = v.T / HARTREE
        extras.append(_INT32.pack(len(extra)))
        extras.append(extra)
    # tobytes: a batch is small next to the model call, and it keeps the types plain.
    return b"".join(
        (
            FORCEREADY,
            energies.tobytes(),
            _INT32.pack(natoms),
            forces.tobytes(),
            virials.tobytes(),
            *extras,
        )
    )


def evaluate_batched(
    runner: ModelRunner, hook: Callable[..., Any] | None, batch: BatchedPosData
) -> list[Result]:
    """One result per structure of ``batch``, in order.

    With the env's ``evaluate_batch`` hook the structures go to the model together;
    should the hook fail as a whole, they are computed one at a time, so an error
    names the structure the model cannot do. Without a hook each is one
    ``runner.compute``. A structure equal to the one before it (i-PI's padding)
    reuses that result instead of running the model again.
    """
    if hook is not None and len(batch) > 1:
        try:
            return _through_hook(runner, hook, batch)
        except Exception as exc:
            log.warning(
                "evaluate_batch failed on a batch of %d (%s: %s); computing them one at a time",
                len(batch),
                type(exc).__name__,
                exc,
            )
    results: list[Result] = []
    for i in range(len(batch)):
        if i and _same_as_previous(batch, i):
            results.append(results[-1])
            continue
        energy, forces, virial, extra = runner.compute(batch.cells[i], batch.positions[i])
        # Copies: a calculator may refill the same arrays on its next call (EMT does).
        results.append((energy, np.array(forces), np.array(virial), extra))
    return results


def _same_as_previous(batch: BatchedPosData, i: int) -> bool:
    return bool(
        np.array_equal(batch.cells[i], batch.cells[i - 1])
        and np.array_equal(batch.positions[i], batch.positions[i - 1])
    )


def _through_hook(
    runner: ModelRunner, hook: Callable[..., Any], batch: BatchedPosData
) -> list[Result]:
    """The batch through the env's ``evaluate_batch(calc, atoms_list, properties)``."""
    template = runner.atoms
    if template is None:
        raise RuntimeError(
            "the worker does not know the species: a standard i-PI server sends "
            "none, so start it with `rootstock serve ... --structure FILE`"
        )
    unique = [i for i in range(len(batch)) if i == 0 or not _same_as_previous(batch, i)]
    repeated = set(range(len(batch))) - set(unique)
    atoms_list = []
    for i in unique:
        if len(batch.positions[i]) != len(template):
            raise ValueError(
                f"the server sent {len(batch.positions[i])} atoms, "
                f"but the structure has {len(template)}"
            )
        atoms = template.copy()
        atoms.cell[:] = batch.cells[i]
        atoms.positions[:] = batch.positions[i]
        atoms_list.append(atoms)
    properties = ["energy", "forces"]
    if runner.want_stress:
        properties.append("stress")
    answers = hook(runner.calc, atoms_list, tuple(properties))
    if not isinstance(answers, list | tuple) or len(answers) != len(atoms_list):
        raise TypeError(
            f"evaluate_batch returned {type(answers).__name__}, "
            f"not a list of {len(atoms_list)} results"
        )
    computed = [
        _hook_result(runner, atoms, answer)
        for atoms, answer in zip(atoms_list, answers, strict=True)
    ]
    results: list[Result] = []
    it = iter(computed)
    for i in range(len(batch)):
        results.append(results[-1] if i in repeated else next(it))
    return results


def _hook_result(runner: ModelRunner, atoms: Any, answer: Any) -> Result:
    """One hook result checked as ``runner.compute`` checks its own."""
    if isinstance(answer, BaseException):
        raise answer
    if not isinstance(answer, dict):
        raise TypeError(
            f"evaluate_batch returned {type(answer).__name__} for a structure, not a dict"
        )
    energy = checked_energy("energy", answer.get("energy"))
    forces = checked_forces(answer.get("forces"), len(atoms))
    a, b, c = atoms.cell.array
    virial = np.zeros((3, 3))
    stress = None
    if runner.want_stress and a.any() and b.any() and c.any():
        if answer.get("stress") is None:
            raise ValueError("evaluate_batch returned no stress, which was asked for")
        stress = checked_stress(answer["stress"])
        virial = -atoms.get_volume() * stress
    if not runner.allow_nonfinite:
        check_finite("energy", energy)
        check_finite("forces", forces)
        if stress is not None:
            check_finite("stress", stress)
    extra = b""
    if answer.get("free_energy") is not None:
        free = checked_energy("free_energy", answer["free_energy"])
        if not runner.allow_nonfinite:
            check_finite("free_energy", free)
        if free != energy:
            # What runner.compute sends a standard server: the free energy alone.
            extra = json.dumps({"free_energy": free}).encode("ascii")
    # A copy: the hook may hand back arrays it refills on its next call.
    return energy, np.array(forces), virial, extra
