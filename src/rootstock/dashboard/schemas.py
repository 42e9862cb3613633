"""Request and response models of the JSON API (the OpenAPI schema is built from them).

Request models check what the dashboard stores. A manifest push is validated
against the manifest's own record types (:mod:`rootstock.install.manifest.types`)
through pydantic, and keeps every key it does not know (``extra="allow"``); a usage
report accepts nothing but counts (``extra="forbid"``), so user hashes or raw
records can never reach the server.
"""

from __future__ import annotations

import math
from datetime import UTC
from types import GenericAlias, UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, NotRequired, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    model_validator,
)
from typing_extensions import TypedDict, get_type_hints, is_typeddict

from rootstock.dashboard.models import INFO, NAME, TIME
from rootstock.install.manifest import (
    DISPLAY_STATES,
    MANIFEST_VERSION,
    BuildRef,
    CheckpointRecord,
    Checks,
    EnvRecord,
    Fingerprint,
    Manifest,
    QuantityCheck,
    Reference,
    Verification,
    parse_time,
)
from rootstock.install.manifest.types import ImageRecord, WeightFile
from rootstock.names import CLUSTER_NAME_PATTERN

INT32 = 2**31 - 1  # the Integer columns' range on PostgreSQL
MAX_USAGE_ROWS = 100_000
MAX_DEPTH = 64
# The years a stored time may fall in: the pages sort and subtract times, and a
# year 9999 (or 0001 shifted by its offset) would overflow there or sort first forever.
TIME_YEARS = (2000, 2200)

ClusterName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=f"^{CLUSTER_NAME_PATTERN.pattern}$")
]
Name = Annotated[str, StringConstraints(min_length=1, max_length=NAME)]
Short = Annotated[str, StringConstraints(min_length=1, max_length=20)]


def _sane_time(text: str) -> str:
    """``text`` unchanged when it is an ISO-8601 time within :data:`TIME_YEARS`.

    A time without an offset is read as UTC, as the pages read it.
    """
    moment = parse_time(text)
    try:
        year = moment.astimezone(UTC).year if moment else None
    except OverflowError:
        year = None
    if year is None:
        raise ValueError("not an ISO-8601 time (e.g. 2026-11-28T10:00:00+00:00)")
    low, high = TIME_YEARS
    if not low <= year <= high:
        raise ValueError(f"a time must fall in the years {low}-{high}")
    return text


Time = Annotated[str, StringConstraints(max_length=TIME), AfterValidator(_sane_time)]
Text = Annotated[str, StringConstraints(max_length=NAME)]
Count = Annotated[int, Field(ge=0, le=INT32)]
State = Literal[DISPLAY_STATES]  # type: ignore[valid-type]  # the tuple is a constant


def storable_text_problem(value: Any, depth: int = 0) -> str | None:
    """Why ``value`` (parsed JSON) cannot be stored on every backend, or None.

    PostgreSQL refuses NUL characters in text, no backend can encode a lone UTF-16
    surrogate, and NaN or infinities cannot be sent back as JSON.
    """
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, str):
        return _text_problem(value)
    if isinstance(value, float):
        return None if math.isfinite(value) else "NaN and infinities are not JSON numbers"
    if isinstance(value, dict):
        for key, item in value.items():
            problem = _text_problem(key) or storable_text_problem(item, depth + 1)
            if problem:
                return problem
    elif isinstance(value, list):
        for item in value:
            problem = storable_text_problem(item, depth + 1)
            if problem:
                return problem
    return None


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "text may not contain NUL characters"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "text may not contain unpaired surrogates"
    return None


# What a manifest push is validated against: the manifest's own record types
# (rootstock.install.manifest.types, which the core checks on every read), rebuilt
# here as pydantic-ready TypedDicts. The core must not import pydantic, and on Python
# 3.11 pydantic needs typing_extensions' TypedDict and reads its config from the
# class, so each record type is derived once, at import, with:
#
# * the same fields and required keys as the core type, nested record types
#   swapped for their derived ones;
# * ``extra="allow"``: unknown keys are kept at every level, as the core keeps them;
# * ``strict=True``: a value is accepted as sent or refused, never converted ("1" is
#   not an integer), so the body kept as history says exactly what was stored;
# * the dashboard's own limits on the fields it stores in columns (the ``limits``
#   each call below passes): lengths, sane times, cluster-name keys. These keep the
#   looser types these fields had before the records were shared (any short
#   ``state``, a null ``mode``, no ``envs``), so no push accepted before is refused
#   for those fields.
OPEN_RECORD = ConfigDict(extra="allow", strict=True)
_DERIVED: dict[type, Any] = {}
# The fields each derived type has beyond its core type: a push adds them to the
# manifest it sends (the file itself never holds them).
PUSH_ONLY_FIELDS: dict[type, frozenset[str]] = {}
# The functional TypedDict form, untyped: the names and fields are only known at runtime.
_make_typed_dict: Any = TypedDict


def _swap(hint: Any) -> Any:
    """``hint`` with every core record type in it replaced by its derived one."""
    if isinstance(hint, type) and is_typeddict(hint):
        if hint not in _DERIVED:
            raise TypeError(f"derive {hint.__name__} before a record that holds it")
        return _DERIVED[hint]
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        return Union[tuple(_swap(arg) for arg in args)]  # noqa: UP007  # built from a tuple
    if origin in (dict, list):
        return GenericAlias(origin, tuple(_swap(arg) for arg in args))
    return hint


def _keyed(key: Any, value: Any) -> Any:
    """``dict[key, value]`` for types built at runtime (which a type checker cannot read)."""
    return GenericAlias(dict, (key, value))


def derive_record(
    core: type,
    name: str,
    limits: dict[str, Any] | None = None,
    added: dict[str, Any] | None = None,
) -> Any:
    """A pydantic-ready copy of the core TypedDict ``core``, named ``name``.

    ``limits`` replaces a field's type (wrap it in ``NotRequired`` for an optional
    key); every other field keeps the core's type and required-ness. ``added``
    declares fields a push carries that the manifest file does not (the client adds
    them to its payload), typed the same way.
    """
    limits = limits or {}
    added = added or {}
    hints = get_type_hints(core)
    unknown = set(limits) - set(hints)
    if unknown:
        raise TypeError(f"{core.__name__} has no fields {sorted(unknown)}")
    clashing = set(added) & set(hints)
    if clashing:
        raise TypeError(f"{core.__name__} already has fields {sorted(clashing)}")
    required: frozenset[str] = getattr(core, "__required_keys__", frozenset())
    fields: dict[str, Any] = {}
    for key, hint in hints.items():
        if key in limits:
            fields[key] = limits[key]
        else:
            swapped = _swap(hint)
            fields[key] = swapped if key in required else NotRequired[swapped]
    fields.update(added)
    if added:
        PUSH_ONLY_FIELDS[core] = frozenset(added)
    derived = _make_typed_dict(name, fields)
    derived.__doc__ = core.__doc__
    derived.__pydantic_config__ = OPEN_RECORD
    _DERIVED[core] = derived
    return derived


_Text = NotRequired[Text | None]
_Time = NotRequired[Time | None]
_Short = NotRequired[Short | None]
_Number = NotRequired[float | None]

BuildRefIn = derive_record(
    BuildRef,
    "BuildRef",
    {"build_id": _Text, "source_hash": _Text, "built_at": _Time, "lock_hash": _Text},
)
FingerprintIn = derive_record(Fingerprint, "Fingerprint")
QuantityCheckIn = derive_record(
    QuantityCheck,
    "QuantityCheck",
    {
        "mode": _Short,
        "ok": NotRequired[bool | None],
        "ratio": _Number,
        "cosine": _Number,
        "norm_ratio": _Number,
    },
)
ChecksIn = derive_record(
    Checks,
    "VerificationChecks",
    {
        "ok": NotRequired[bool | None],
        "dtype": _Short,
        "energy": _Short,
        "forces": NotRequired[QuantityCheckIn | None],
        "stress": NotRequired[QuantityCheckIn | None],
    },
)
ReferenceIn = derive_record(Reference, "Reference")
VerificationIn = derive_record(
    Verification,
    "VerificationRecord",
    {
        "state": _Short,
        "at": _Time,
        "device": _Text,
        "device_kind": _Short,
        "fingerprint": NotRequired[FingerprintIn | None],
        "checks": NotRequired[ChecksIn | None],
        "build": NotRequired[BuildRefIn | None],
    },
)
WeightFileIn = derive_record(WeightFile, "WeightFile")
InfoText = Annotated[str, StringConstraints(max_length=INFO)]


class CheckpointInfoIn(TypedDict, total=False):
    """What a checkpoint is, from its env file's ``CHECKPOINT_INFO`` (a push adds it).

    ``gated`` is the URL where access is requested, null when the checkpoint is not
    gated. Other ``CHECKPOINT_INFO`` fields a newer client sends are kept and ignored.
    """

    __pydantic_config__ = OPEN_RECORD  # type: ignore[misc]  # pydantic reads it from the class

    licence: NotRequired[InfoText | None]
    gated: NotRequired[InfoText | None]
    citation: NotRequired[InfoText | None]


CheckpointIn = derive_record(
    CheckpointRecord,
    "CheckpointEntry",
    {
        "fetched_at": _Time,
        "verifications": NotRequired[_keyed(ClusterName, _keyed(Short, VerificationIn))],
    },
    added={"info": NotRequired[CheckpointInfoIn | None]},
)
ImageIn = derive_record(ImageRecord, "EnvImage")
EnvIn = derive_record(
    EnvRecord,
    "EnvEntry",
    {
        "build_id": _Text,
        "source_hash": _Text,
        "built_at": _Time,
        "python": _Text,
        "torch": _Text,
        "rootstock": _Text,
        "checkpoints": NotRequired[_keyed(Name, CheckpointIn)],
    },
)
ManifestRecord = derive_record(
    Manifest,
    "ManifestIn",
    {
        "schema_version": Annotated[int, Field(ge=1, le=MANIFEST_VERSION)],
        "clusters": Annotated[list[ClusterName], Field(min_length=1, max_length=1000)],
        "envs": NotRequired[_keyed(Name, EnvIn)],
    },
)


def _storable(data: Any) -> Any:
    """Refuse a body with text or numbers that not every database can store."""
    problem = storable_text_problem(data)
    if problem:
        raise ValueError(problem)
    return data


if TYPE_CHECKING:
    # To the type checker a validated push is the core's Manifest: the derived type
    # has its fields, only with the dashboard's limits on some of them.
    ManifestIn = Manifest
else:
    # One cluster's view of an install's manifest.json (docs/manifest.md): the
    # request body of ``PUT .../manifest``. FastAPI validates it with a TypeAdapter.
    ManifestIn = Annotated[ManifestRecord, BeforeValidator(_storable)]

MANIFEST_ADAPTER: TypeAdapter[Manifest] = TypeAdapter(ManifestIn)
"""Validates a pushed manifest as the API does (``validate_python`` / ``validate_json``)."""


class _StorableText(BaseModel):
    """Refuses a body with text or numbers that not every database can store."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        return _storable(data)


class UsageCountIn(_StorableText):
    """Aggregated usage of one checkpoint on one cluster in one month."""

    model_config = ConfigDict(extra="forbid", strict=True)

    month: Annotated[str, StringConstraints(pattern=r"^[0-9]{4}-(0[1-9]|1[0-2])$")]
    env: Name
    checkpoint: Name
    sessions: Count
    distinct_users: Count
    force_calls: Count = 0


class UsageIn(BaseModel):
    """``POST .../usage``: monthly counts and nothing else."""

    model_config = ConfigDict(extra="forbid", strict=True)

    version: Literal[1] = 1
    counts: list[UsageCountIn] = Field(max_length=MAX_USAGE_ROWS)


class PushOut(BaseModel):
    """The answer to an accepted manifest push."""

    cluster: str
    push_id: int
    received_at: str
    envs: int
    checkpoints: int


class UsageOut(BaseModel):
    """The answer to an accepted usage push."""

    cluster: str
    rows: int


class ManifestOut(BaseModel):
    """A cluster's latest manifest."""

    cluster: str
    push_id: int
    received_at: str | None
    manifest: dict[str, Any]


class PushSummary(BaseModel):
    """One push in a cluster's history."""

    push_id: int
    received_at: str | None
    envs: int
    checkpoints: int


class PushHistoryOut(BaseModel):
    """A cluster's pushes, newest first."""

    cluster: str
    pushes: list[PushSummary]


class ClusterSummary(BaseModel):
    """A cluster and its last push."""

    name: str
    last_push_at: str | None
    envs: int
    checkpoints: int


class ClusterListOut(BaseModel):
    """Every cluster the dashboard knows."""

    clusters: list[ClusterSummary]


class CoverageCellOut(BaseModel):
    """One checkpoint on one cluster."""

    env: str
    state: str
    verified_at: str | None
    device_kind: str | None
    message: str | None


class CoverageRowOut(BaseModel):
    """One checkpoint across the clusters."""

    checkpoint: str
    family: str
    cells: dict[str, CoverageCellOut]


class CoverageColumnOut(BaseModel):
    """One cluster column."""

    name: str
    last_push_at: str | None


class CoverageOut(BaseModel):
    """The checkpoint x cluster matrix."""

    version: int
    generated_at: str
    clusters: list[CoverageColumnOut]
    families: list[str]
    checkpoints: list[CoverageRowOut]


class CatalogueDeviceOut(BaseModel):
    """The latest result of one device kind on one cluster."""

    device_kind: str
    device: str | None
    state: str | None
    at: str | None
    message: str | None


class CatalogueClusterOut(BaseModel):
    """A checkpoint on one cluster: its cell's state and its results per device kind."""

    cluster: str
    env: str
    state: str
    message: str | None
    devices: list[CatalogueDeviceOut]


class CatalogueEntryOut(BaseModel):
    """One checkpoint: what it is and where it is verified."""

    checkpoint: str
    family: str
    described: bool
    licence: str | None
    gated: str | None
    citation: str | None
    verified_on: list[str]
    clusters: list[CatalogueClusterOut]


class CatalogueOut(BaseModel):
    """Every checkpoint across clusters."""

    version: int
    generated_at: str
    checkpoints: list[CatalogueEntryOut]


class ErrorOut(BaseModel):
    """An error with a message."""

    detail: str
