"""The manifest's records, declared once as TypedDicts (documented in ``docs/manifest.md``).

These are the shapes :mod:`.validate` checks on every read and before every write, so
a manifest returned by :func:`~rootstock.install.manifest.load_manifest` is a
:class:`Manifest`. They are plain dicts at runtime: ``status`` reads thousands of
records per call, and no per-record conversion happens anywhere.

A key is ``NotRequired`` where :mod:`.validate` accepts it absent (read as null); it
is ``Required`` where the validator refuses a record without it (``state``,
``clusters``, ``envs``, a reference's ``fingerprint``). Every record also tolerates
keys not named here (a later minor addition need not bump the schema version), so a
reader must never assume it has seen all of a record's keys.

The dashboard validates pushes against these same types through pydantic's
``TypeAdapter``; nothing here imports pydantic, so the core stays stdlib-only.
"""

# No ``from __future__ import annotations`` here: on Python 3.11 it hides
# ``NotRequired`` from TypedDict, and ``__required_keys__`` would claim every key.
from typing import Any, Literal, NotRequired, TypedDict

VerificationState = Literal["verified", "failed", "drifted", "tampered"]
"""A stored verification outcome (``stale`` and the rest are derived, never stored).

``tampered``: a weight file of the checkpoint no longer matches what ``add`` recorded
(its size or sha256 changed), so the verification refused to run the model.
"""

JsonObject = dict[str, Any]
"""An open-ended JSON object whose inside the schema leaves to its writer."""


class BuildRef(TypedDict, total=False):
    """The env build a verification (or a reference) ran against."""

    build_id: str | None
    source_hash: str | None
    built_at: str | None
    lock_hash: str | None


class Fingerprint(TypedDict, total=False):
    """The numbers a verification measured on the reference structure."""

    energy_per_atom: float | None
    force_norm: float | None
    stress: list[float] | None
    natoms: int | None
    device_kind: str | None
    torch: str | None
    env_versions: dict[str, str] | None


class Reference(TypedDict):
    """An accepted fingerprint later verifications are judged against."""

    fingerprint: Fingerprint
    at: NotRequired[str | None]
    build: NotRequired[BuildRef | None]
    kwargs: NotRequired[JsonObject | None]


class QuantityCheck(TypedDict, total=False):
    """One quantity's verdict (``forces`` or ``stress``) inside :class:`Checks`."""

    mode: str
    ok: bool
    ratio: float | None
    cosine: float | None
    norm_ratio: float | None
    tol: JsonObject
    directions: int
    message: str | None


class Checks(TypedDict, total=False):
    """The physics checks model-family verification adds (forces, stress vs energy).

    Written by ``ops/consistency.py`` (``ConsistencyReport.to_dict``) plus the
    ``seconds`` that ``ops/verify.py`` adds. The validator keeps this object open
    (any finite JSON), so every key is optional to a reader.
    """

    ok: bool
    dtype: str
    model_dtype: str | None
    step: float
    energy: str
    energy_calls: int
    seconds: float
    forces: QuantityCheck
    stress: QuantityCheck


class Verification(TypedDict):
    """The latest result on one cluster for one device kind.

    Stored at ``envs[<env>].checkpoints[<id>].verifications[<cluster>][<device_kind>]``.
    ``staged`` says how the verifying worker was started: ``"mount"`` (from a
    squashfuse mount of the env's image), ``"copy"`` (from a node-local extracted
    copy), or None (from the shared env, or a record from before schema 3).
    """

    state: VerificationState
    at: NotRequired[str | None]
    device: NotRequired[str | None]
    device_kind: NotRequired[str | None]
    staged: NotRequired[str | None]
    message: NotRequired[str | None]
    kwargs: NotRequired[JsonObject | None]
    fingerprint: NotRequired[Fingerprint | None]
    reference: NotRequired[Reference | None]
    references: NotRequired[dict[str, Reference]]
    drift: NotRequired[JsonObject | None]
    checks: NotRequired[Checks | None]
    build: NotRequired[BuildRef | None]


class WeightFile(TypedDict):
    """One weight file as ``add`` recorded it, just after the fetch.

    ``size`` in bytes, ``sha256`` 64 lower-case hex characters, ``mtime`` the file's
    modification time (seconds since the epoch, as ``os.stat`` gives it). Verification
    compares size and mtime, and re-hashes when they changed (or on ``--rehash``).
    """

    size: int
    sha256: str
    mtime: float


class CheckpointRecord(TypedDict, total=False):
    """A checkpoint an env serves: when it was fetched, and its verifications.

    ``files`` lists what the download brought, relative to the cache root (absent:
    unattributed, from before ``add`` recorded it; ``prune`` never deletes those).
    ``weights`` maps each regular file among them (the same relative paths) to its
    :class:`WeightFile` (absent: recorded before weights were hashed).
    ``verifications[<cluster>][<device_kind>]`` is a :class:`Verification`.
    """

    fetched_at: str | None
    files: list[str]
    weights: dict[str, WeightFile]
    verifications: dict[str, dict[str, Verification]]


class ImageRecord(TypedDict):
    """The read-only squashfs image of an env's build, inside its generation directory.

    ``file`` is a plain file name relative to that directory, ``sha256`` the image's
    digest (64 lower-case hex characters), ``size`` its length in bytes and
    ``compression`` the mksquashfs compressor and level (``zstd-3``, ``lz4``).
    """

    file: str
    sha256: str
    size: int
    compression: str


class EnvRecord(TypedDict, total=False):
    """An env's current build (written by ``install``) and its checkpoints.

    ``image`` is None for a build made without an image (``install --no-image``,
    images off for the root, or a build recorded before schema 3).
    """

    build_id: str | None
    source_hash: str | None
    lock_hash: str | None
    built_at: str | None
    python: str | None
    python_path: str | None
    torch: str | None
    rootstock: str | None
    image: ImageRecord | None
    checkpoints: dict[str, CheckpointRecord]


class Manifest(TypedDict):
    """The whole of ``{root}/manifest.json`` in the current schema."""

    schema_version: int
    clusters: list[str]
    created_at: NotRequired[str | None]
    updated_at: NotRequired[str | None]
    written_by: NotRequired[str | None]
    envs: dict[str, EnvRecord]


RECORD_TYPES: tuple[type, ...] = (
    Manifest,
    EnvRecord,
    ImageRecord,
    CheckpointRecord,
    WeightFile,
    Verification,
    Reference,
    Fingerprint,
    BuildRef,
    Checks,
    QuantityCheck,
)
"""Every record type, in the order ``docs/manifest.md`` describes them."""
