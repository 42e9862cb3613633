"""Request and response models of the JSON API (the OpenAPI schema is built from them).

Request models check what the dashboard stores; a manifest keeps every key it
does not know (``extra="allow"``), a usage report accepts nothing but counts
(``extra="forbid"``), so user hashes or raw records can never reach the server.
"""

from __future__ import annotations

import math
from datetime import UTC
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from rootstock.dashboard.models import NAME, TIME
from rootstock.install.manifest import DISPLAY_STATES, MANIFEST_VERSION, parse_time
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


class _Open(BaseModel):
    """An object that keeps keys the dashboard does not know.

    Strict: a value is accepted as sent or refused, never converted ("1" is not an
    integer), so the body kept as history says exactly what was stored.
    """

    model_config = ConfigDict(extra="allow", strict=True)


class BuildRef(_Open):
    """The build a verification ran against."""

    build_id: Text | None = None
    source_hash: Text | None = None
    built_at: Time | None = None
    lock_hash: Text | None = None


class Fingerprint(_Open):
    """The numbers a verification measured (only the energy is stored in its own column)."""

    energy_per_atom: float | None = None


class QuantityCheck(_Open):
    """How one quantity (forces, stress) compared with the energy's derivative."""

    mode: Short | None = None
    ok: bool | None = None
    ratio: float | None = None
    cosine: float | None = None
    norm_ratio: float | None = None
    message: str | None = None


class VerificationChecks(_Open):
    """A verification's physics checks (docs/manifest.md, "Physics checks")."""

    ok: bool | None = None
    dtype: Short | None = None
    energy: Short | None = None
    forces: QuantityCheck | None = None
    stress: QuantityCheck | None = None


class VerificationRecord(_Open):
    """One cluster's latest verification for one device kind."""

    state: Short | None = None
    at: Time | None = None
    device: Text | None = None
    device_kind: Short | None = None
    message: str | None = None
    fingerprint: Fingerprint | None = None
    checks: VerificationChecks | None = None
    build: BuildRef | None = None


class CheckpointEntry(_Open):
    """A checkpoint an env serves: when it was fetched, and its verifications."""

    fetched_at: Time | None = None
    verifications: dict[ClusterName, dict[Short, VerificationRecord]] = Field(default_factory=dict)


class EnvEntry(_Open):
    """An env's current build and its checkpoints."""

    build_id: Text | None = None
    source_hash: Text | None = None
    built_at: Time | None = None
    python: Text | None = None
    torch: Text | None = None
    rootstock: Text | None = None
    checkpoints: dict[Name, CheckpointEntry] = Field(default_factory=dict)


class _StorableText(BaseModel):
    """Refuses a body with text or numbers that not every database can store."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        problem = storable_text_problem(data)
        if problem:
            raise ValueError(problem)
        return data


class ManifestIn(_Open, _StorableText):
    """One cluster's view of an install's ``manifest.json`` (see docs/manifest.md)."""

    schema_version: int = Field(ge=1, le=MANIFEST_VERSION)
    clusters: list[ClusterName] = Field(min_length=1, max_length=1000)
    envs: dict[Name, EnvEntry] = Field(default_factory=dict)


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


class ErrorOut(BaseModel):
    """An error with a message."""

    detail: str
