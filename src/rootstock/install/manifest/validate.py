"""The manifest schema, checked field by field: on every read and before every write.

:func:`check_manifest` walks a current-schema manifest (an older one is migrated
first) and raises :class:`SchemaProblem` for the first field of the wrong type,
naming its JSON path (``envs["emt"].checkpoints["emt-a"].verifications["alpha"]
["cpu"].state``). Unknown keys are tolerated at every level (a later minor
addition need not bump the version), but their values, like every value whose
inside the schema leaves open (``kwargs``, ``checks``, ``drift``, a fingerprint),
must still be finite JSON nested at most :data:`OPAQUE_DEPTH` deep.

The walk visits every value once, so the reader can parse with
``loads_json(..., walked_by_caller=True)`` and skip its two whole-tree passes:
the manifest of a large install is megabytes, and ``status`` reads it each time.

Names are not refused here: a cluster name, device or device kind that today's
rule (:mod:`rootstock.names`) refuses is returned as a :class:`StoredName`, so
the reader can warn with the fix while the install stays usable.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rootstock.install.manifest.schema import (
    BUILD_REF_FIELDS,
    ENV_BUILD_FIELDS,
    IMAGE_FIELDS,
    STAGED_MODES,
    VERIFICATION_STATES,
    WEIGHT_FIELDS,
)
from rootstock.install.manifest.state import parse_time
from rootstock.names import is_cluster_name, is_device_name

# Every opaque value sits at most ~10 levels down the schema, so this keeps the
# whole file well inside parsing.MAX_DEPTH, and every recursive copy of it
# (deepcopy, json.dumps) well inside the interpreter's stack.
OPAQUE_DEPTH = 32
DEVICE_KINDS = frozenset(("cpu", "gpu", "xpu"))
STATES = frozenset(VERIFICATION_STATES)
# ``built_at`` is a timestamp and ``image`` an object: every other build field is text.
ENV_TEXT_FIELDS = tuple(f for f in ENV_BUILD_FIELDS if f not in ("built_at", "image"))
BUILD_TEXT_FIELDS = tuple(f for f in BUILD_REF_FIELDS if f != "built_at")

_TOP_KEYS = frozenset(
    ("schema_version", "clusters", "created_at", "updated_at", "written_by", "envs")
)
_ENV_KEYS = frozenset((*ENV_TEXT_FIELDS, "built_at", "image", "checkpoints"))
_IMAGE_KEYS = frozenset(IMAGE_FIELDS)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHECKPOINT_KEYS = frozenset(("fetched_at", "files", "weights", "verifications"))
_WEIGHT_KEYS = frozenset(WEIGHT_FIELDS)
#: The most entries a checkpoint's ``files`` may list; a download that brings more
#: is recorded without ``files`` (unattributed: ``prune`` never deletes its weights).
MAX_CHECKPOINT_FILES = 100_000
_RECORD_KEYS = frozenset(
    (
        "state",
        "at",
        "device",
        "device_kind",
        "staged",
        "message",
        "kwargs",
        "fingerprint",
        "reference",
        "references",
        "drift",
        "checks",
        "build",
    )
)
_REFERENCE_KEYS = frozenset(("fingerprint", "at", "build", "kwargs"))
_BUILD_KEYS = frozenset((*BUILD_TEXT_FIELDS, "built_at"))
_FINGERPRINT_KEYS = frozenset(
    ("energy_per_atom", "force_norm", "stress", "natoms", "device_kind", "torch", "env_versions")
)
_MISSING = object()

Path = tuple[Any, ...]  # field names as str, object keys wrapped in a 1-tuple


class SchemaProblem(ValueError):
    """A field of the wrong type: ``where`` is its JSON path, ``what`` the problem."""

    def __init__(self, where: Path, what: str) -> None:
        self.where = json_path(where)
        self.what = what
        super().__init__(f"{self.where}: {what}" if self.where else what)


@dataclass(frozen=True)
class StoredName:
    """A stored name today's rule refuses: ``kind`` is cluster name, device or device kind."""

    kind: str
    value: str
    where: str


def json_path(parts: Path) -> str:
    """``("envs", ("emt",), "checkpoints")`` as ``envs["emt"].checkpoints``."""
    text = ""
    for part in parts:
        if isinstance(part, tuple):
            key = str(part[0])
            key = key if len(key) <= 60 else key[:59] + "…"
            text += f"[{json.dumps(key)}]"
        elif isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def describe(value: Any) -> str:
    """A short user-facing rendering of a found value (``5``, ``"soon"``, ``a list``)."""
    if value is _MISSING:
        return "missing"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value if len(value) <= 40 else value[:39] + "…")
    if isinstance(value, int | float):
        return repr(value) if isinstance(value, int) or math.isfinite(value) else str(value)
    return "an object" if isinstance(value, dict) else "a list"


def check_manifest(data: Mapping[str, Any]) -> list[StoredName]:
    """Check every field of a current-schema manifest; return the now-invalid names.

    ``data`` is untrusted parsed JSON (or a :class:`~.types.Manifest` about to be
    written); once this returns, it has the shape :mod:`.types` declares. Raises
    :class:`SchemaProblem` for the first field of the wrong type.
    """
    walk = _Walk()
    walk.top(data)
    return walk.names


def opaque_problem(value: Any) -> str | None:
    """Why ``value`` cannot be stored as open-ended manifest JSON, or None.

    Refuses non-finite numbers, nesting deeper than :data:`OPAQUE_DEPTH` and
    values JSON has no type for. Iterative, so it cannot run out of stack.
    """
    try:
        _opaque(value, ())
    except SchemaProblem as exc:
        return str(exc)
    return None


class _Walk:
    """One pass over a manifest; caches the strings already found valid.

    Paths are tuples built only on the way down to containers; a leaf's own path
    is spelled out only when it is refused.
    """

    def __init__(self) -> None:
        self.names: list[StoredName] = []
        self.times: set[str] = set()
        self.good_clusters: set[str] = set()
        self.good_devices: set[str] = set()
        # The last checked value of a few text-only parts that repeat from record to
        # record (a build, env_versions): one equal to it needs no second look.
        self.memo: dict[str, Any] = {}

    def top(self, data: Mapping[str, Any]) -> None:
        version = data.get("schema_version", _MISSING)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise SchemaProblem(("schema_version",), _must("a non-negative integer", version))
        clusters = data.get("clusters", _MISSING)
        if not isinstance(clusters, list):
            raise SchemaProblem(("clusters",), _must("a list of cluster names", clusters))
        for index, name in enumerate(clusters):
            if not isinstance(name, str):
                raise SchemaProblem(("clusters", index), _must("a cluster name (text)", name))
            self.cluster(name, ("clusters", index))
        self.time_or_null(data, (), "created_at")
        self.time_or_null(data, (), "updated_at")
        _text_or_null(data, (), "written_by")
        envs = data.get("envs", _MISSING)
        if not isinstance(envs, dict):
            raise SchemaProblem(("envs",), _must("an object of envs", envs))
        for name, env in envs.items():
            self.env(env, ("envs", (name,)))
        _unknown(data, _TOP_KEYS, ())

    def env(self, env: Any, where: Path) -> None:
        if not isinstance(env, dict):
            raise SchemaProblem(where, _must("an object", env))
        for field in ENV_TEXT_FIELDS:
            _text_or_null(env, where, field)
        self.time_or_null(env, where, "built_at")
        image = env.get("image")
        if image is not None:
            _image(image, (*where, "image"))
        checkpoints = env.get("checkpoints", _MISSING)
        if checkpoints is not _MISSING:
            if not isinstance(checkpoints, dict):
                raise SchemaProblem((*where, "checkpoints"), _must("an object", checkpoints))
            for cid, entry in checkpoints.items():
                self.checkpoint(entry, (*where, "checkpoints", (cid,)))
        _unknown(env, _ENV_KEYS, where)

    def checkpoint(self, entry: Any, where: Path) -> None:
        if not isinstance(entry, dict):
            raise SchemaProblem(where, _must("an object", entry))
        self.time_or_null(entry, where, "fetched_at")
        files = entry.get("files", _MISSING)
        if files is not _MISSING:
            _files(files, (*where, "files"))
        weights = entry.get("weights", _MISSING)
        if weights is not _MISSING:
            _weights(weights, (*where, "weights"))
        verifications = entry.get("verifications", _MISSING)
        if verifications is not _MISSING:
            if not isinstance(verifications, dict):
                raise SchemaProblem(
                    (*where, "verifications"), _must("an object of clusters", verifications)
                )
            check_record = self.record
            for cluster, by_kind in verifications.items():
                at = (*where, "verifications", (cluster,))
                if cluster not in self.good_clusters:
                    self.cluster(cluster, at)
                if not isinstance(by_kind, dict):
                    raise SchemaProblem(at, _must("an object of device kinds", by_kind))
                for kind, record in by_kind.items():
                    if kind not in DEVICE_KINDS:
                        self.names.append(StoredName("device kind", kind, json_path(at)))
                    check_record(record, (*at, (kind,)))
        _unknown(entry, _CHECKPOINT_KEYS, where)

    def record(self, record: Any, where: Path) -> None:
        # The hot loop of every read (thousands of records): fields are fetched
        # once and the common types tested inline; helpers only for the rest.
        if not isinstance(record, dict):
            raise SchemaProblem(where, _must("a verification record (an object)", record))
        get = record.get
        state = get("state", _MISSING)
        if not isinstance(state, str) or state not in STATES:
            raise SchemaProblem((*where, "state"), _must(_one_of(VERIFICATION_STATES), state))
        at = get("at")
        if at is not None and not (type(at) is str and at in self.times):
            self.time_or_null(record, where, "at")
        device = get("device")
        if device is not None:
            if not isinstance(device, str):
                raise SchemaProblem((*where, "device"), _must("a device string", device))
            if device not in self.good_devices:
                if is_device_name(device):
                    self.good_devices.add(device)
                else:
                    where_device = json_path((*where, "device"))
                    self.names.append(StoredName("device", device, where_device))
        kind = get("device_kind")
        if kind is not None:
            if not isinstance(kind, str):
                raise SchemaProblem(
                    (*where, "device_kind"), _must(_one_of(sorted(DEVICE_KINDS)), kind)
                )
            if kind not in DEVICE_KINDS:
                where_kind = json_path((*where, "device_kind"))
                self.names.append(StoredName("device kind", kind, where_kind))
        staged = get("staged")
        if staged is not None and not isinstance(staged, str):
            # Any text is read (a later rootstock may stage another way); writers
            # store only STAGED_MODES.
            raise SchemaProblem(
                (*where, "staged"), _must(f"{_one_of(STAGED_MODES)} or null", staged)
            )
        message = get("message")
        if message is not None and not isinstance(message, str):
            raise SchemaProblem((*where, "message"), _must("text or null", message))
        for field in ("kwargs", "drift", "checks"):
            value = get(field)
            if value is not None:
                if not isinstance(value, dict):
                    raise SchemaProblem((*where, field), _must("an object or null", value))
                if value:
                    _opaque(value, (*where, field))
        fingerprint = get("fingerprint")
        if fingerprint is not None:
            _fingerprint(fingerprint, where, "fingerprint", self.memo)
        build = get("build")
        if build is not None and not (type(build) is dict and build == self.memo.get("build")):
            self.build(build, (*where, "build"))
        reference = get("reference")
        if reference is not None:
            self.reference(reference, (*where, "reference"), fingerprint, build)
        references = get("references", _MISSING)
        if references is not _MISSING:
            if not isinstance(references, dict):
                raise SchemaProblem(
                    (*where, "references"), _must("an object of references", references)
                )
            for key, value in references.items():
                # Usually a copy of ``reference``, already checked: equal is as good.
                if reference is None or value != reference:
                    self.reference(value, (*where, "references", (key,)), fingerprint, build)
        if not record.keys() <= _RECORD_KEYS:
            _unknown(record, _RECORD_KEYS, where)

    def reference(self, reference: Any, where: Path, fingerprint: Any, build: Any) -> None:
        if not isinstance(reference, dict):
            raise SchemaProblem(
                where, _must("an object {fingerprint, at, build, kwargs}", reference)
            )
        ref_fingerprint = reference.get("fingerprint", _MISSING)
        if not isinstance(ref_fingerprint, dict):
            raise SchemaProblem((*where, "fingerprint"), _must("an object", ref_fingerprint))
        # The first pass's reference is its own fingerprint and build: equal to what
        # was just checked, so as good.
        if ref_fingerprint != fingerprint:
            _fingerprint(ref_fingerprint, where, "fingerprint", self.memo)
        at = reference.get("at")
        if at is not None and not (type(at) is str and at in self.times):
            self.time_or_null(reference, where, "at")
        ref_build = reference.get("build")
        if ref_build is not None and ref_build != build:
            self.build(ref_build, (*where, "build"))
        kwargs = reference.get("kwargs")
        if kwargs:
            _object_or_null(reference, where, "kwargs")
        elif kwargs is not None and type(kwargs) is not dict:
            raise SchemaProblem((*where, "kwargs"), _must("an object or null", kwargs))
        if not reference.keys() <= _REFERENCE_KEYS:
            _unknown(reference, _REFERENCE_KEYS, where)

    def build(self, build: Any, where: Path) -> None:
        if build == self.memo.get("build") and type(build) is dict:
            return
        if not isinstance(build, dict):
            raise SchemaProblem(where, _must("an object {build_id, source_hash, ...}", build))
        for field in BUILD_TEXT_FIELDS:
            _text_or_null(build, where, field)
        self.time_or_null(build, where, "built_at")
        _unknown(build, _BUILD_KEYS, where)
        self.memo["build"] = build

    def time_or_null(self, obj: Mapping[str, Any], where: Path, field: str) -> None:
        """``obj[field]``, when present and not null, is a timestamp ``parse_time`` reads."""
        value = obj.get(field)
        if value is None or (type(value) is str and value in self.times):
            return
        if isinstance(value, str) and parse_time(value) is not None:
            self.times.add(value)
            return
        raise SchemaProblem((*where, field), _must("an ISO-8601 timestamp or null", value))

    def cluster(self, name: str, where: Path) -> None:
        if name in self.good_clusters:
            return
        if is_cluster_name(name):
            self.good_clusters.add(name)
        else:
            self.names.append(StoredName("cluster name", name, json_path(where)))


def cache_path_problem(value: Any) -> str | None:
    """Why ``value`` is not a clean path relative to the cache root, or None.

    Clean: non-empty text, ``/``-separated, not absolute, with no NUL and no empty,
    ``.`` or ``..`` component, so joined to the cache root it can never leave it.
    """
    if not isinstance(value, str):
        return _must("a path relative to the cache root (text)", value)
    if not value:
        return "must be a path relative to the cache root, not empty text"
    if "\0" in value:
        return "must not hold a NUL character"
    if value.startswith("/"):
        return f"must be relative to the cache root, not the absolute path {describe(value)}"
    if any(part in ("", ".", "..") for part in value.split("/")):
        return f"must be a clean relative path (no empty, '.' or '..' part), not {describe(value)}"
    return None


def image_problem(value: Any) -> str | None:
    """Why ``value`` is not an env's ``image`` record (nor null), or None.

    The message starts with the field at fault (``sha256: must be ...``) when it is
    one of the record's. Unknown keys are refused here, where a writer hands in a
    record; a reader tolerates them (:func:`check_manifest`).
    """
    if value is None:
        return None
    try:
        _image(value, ())
    except SchemaProblem as exc:
        return str(exc)
    if isinstance(value, dict) and not value.keys() <= _IMAGE_KEYS:
        return f"unknown keys {sorted(value.keys() - _IMAGE_KEYS)}"
    return None


def image_file_problem(value: Any) -> str | None:
    """Why ``value`` is not an image's ``file``: a plain name in the generation directory."""
    if not isinstance(value, str) or not value:
        return _must("a file name (non-empty text)", value)
    if "/" in value or "\0" in value or value in (".", ".."):
        return f"must be a plain file name (no '/' or NUL, not '.' or '..'), not {describe(value)}"
    return None


def _image(image: Any, where: Path) -> None:
    """An env's ``image``: ``{file, sha256, size, compression}``, each field checked."""
    if not isinstance(image, dict):
        raise SchemaProblem(
            where, _must("an object {file, sha256, size, compression} or null", image)
        )
    problem = image_file_problem(image.get("file", _MISSING))
    if problem:
        raise SchemaProblem((*where, "file"), problem)
    digest = image.get("sha256", _MISSING)
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise SchemaProblem((*where, "sha256"), _must("64 lower-case hex characters", digest))
    size = image.get("size", _MISSING)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise SchemaProblem((*where, "size"), _must("a non-negative integer (bytes)", size))
    compression = image.get("compression", _MISSING)
    if not isinstance(compression, str) or not compression:
        raise SchemaProblem((*where, "compression"), _must("non-empty text", compression))
    _unknown(image, _IMAGE_KEYS, where)


def _files(files: Any, where: Path) -> None:
    """A checkpoint's ``files``: a list of clean cache-root-relative paths, bounded."""
    if not isinstance(files, list):
        raise SchemaProblem(where, _must("a list of paths relative to the cache root", files))
    if len(files) > MAX_CHECKPOINT_FILES:
        raise SchemaProblem(
            where, f"must list at most {MAX_CHECKPOINT_FILES} files, not {len(files)}"
        )
    for index, value in enumerate(files):
        problem = cache_path_problem(value)
        if problem:
            raise SchemaProblem((*where, index), problem)


def weights_problem(value: Any) -> str | None:
    """Why ``value`` is not a checkpoint's ``weights`` record, or None.

    The message starts with the JSON path inside it at fault (``["a/b"].sha256: ...``).
    Unknown keys of a file's entry are refused here, where a writer hands one in; a
    reader tolerates them (:func:`check_manifest`).
    """
    try:
        _weights(value, ())
    except SchemaProblem as exc:
        return str(exc)
    for path, entry in value.items():
        if not entry.keys() <= _WEIGHT_KEYS:
            return f"{json_path(((path,),))}: unknown keys {sorted(entry.keys() - _WEIGHT_KEYS)}"
    return None


def _weights(weights: Any, where: Path) -> None:
    """A checkpoint's ``weights``: clean cache-root paths to ``{size, sha256, mtime}``."""
    if not isinstance(weights, dict):
        raise SchemaProblem(where, _must("an object of weight files", weights))
    if len(weights) > MAX_CHECKPOINT_FILES:
        raise SchemaProblem(
            where, f"must hold at most {MAX_CHECKPOINT_FILES} files, not {len(weights)}"
        )
    for path, entry in weights.items():
        at = (*where, (path,))
        problem = cache_path_problem(path)
        if problem:
            raise SchemaProblem(at, problem)
        if not isinstance(entry, dict):
            raise SchemaProblem(at, _must("an object {size, sha256, mtime}", entry))
        size = entry.get("size", _MISSING)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise SchemaProblem((*at, "size"), _must("a non-negative integer (bytes)", size))
        digest = entry.get("sha256", _MISSING)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise SchemaProblem((*at, "sha256"), _must("64 lower-case hex characters", digest))
        mtime = entry.get("mtime", _MISSING)
        if isinstance(mtime, bool) or not _is_finite_number(mtime):
            raise SchemaProblem((*at, "mtime"), _must("a finite number (seconds)", mtime))
        _unknown(entry, _WEIGHT_KEYS, at)


def _fingerprint(fingerprint: Any, parent: Path, field: str, memo: dict[str, Any]) -> None:
    """Check ``parent[field]``; its path is only spelled out on a refusal."""
    if not isinstance(fingerprint, dict):
        raise SchemaProblem((*parent, field), _must("an object", fingerprint))
    get = fingerprint.get
    for quantity in ("energy_per_atom", "force_norm"):
        value = get(quantity)
        if value is not None and not _is_finite_number(value):
            where = (*parent, field, quantity)
            raise SchemaProblem(where, _must("a finite number or null", value))
    stress = get("stress")
    if stress is not None:
        if not isinstance(stress, list | tuple):
            where = (*parent, field, "stress")
            raise SchemaProblem(where, _must("a list of numbers or null", stress))
        for value in stress:
            kind = type(value)
            if (kind is not float or value - value != 0.0) and (
                kind is not int and not _is_finite_number(value)
            ):
                where = (*parent, field, "stress")
                raise SchemaProblem(where, _must("a list of finite numbers or null", value))
    for key in ("natoms", "device_kind", "torch"):
        value = get(key)
        if value is not None and type(value) is not str and type(value) is not int:
            _opaque(value, (*parent, field, key))
    # Text-only maps repeat from record to record: one equal to the last checked
    # one is as good.
    versions = get("env_versions")
    if versions is not None and versions != memo.get("env_versions"):
        _opaque(versions, (*parent, field, "env_versions"))
        memo["env_versions"] = versions
    if not fingerprint.keys() <= _FINGERPRINT_KEYS:
        _unknown(fingerprint, _FINGERPRINT_KEYS, (*parent, field))


def _is_finite_number(value: Any) -> bool:
    kind = type(value)
    if kind is float:
        return value - value == 0.0  # inf - inf and nan - nan are nan
    if kind is int:
        return True
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _text_or_null(obj: Mapping[str, Any], where: Path, field: str) -> None:
    value = obj.get(field)
    if value is not None and not isinstance(value, str):
        raise SchemaProblem((*where, field), _must("text or null", value))


def _object_or_null(obj: dict[str, Any], where: Path, field: str) -> None:
    value = obj.get(field)
    if value is None:
        return
    if not isinstance(value, dict):
        raise SchemaProblem((*where, field), _must("an object or null", value))
    _opaque(value, (*where, field))


def _unknown(obj: Mapping[str, Any], known: frozenset[str], where: Path) -> None:
    """Tolerate keys the schema does not name, as long as their values are sound JSON."""
    if obj.keys() <= known:
        return
    for key in obj.keys() - known:
        _opaque(obj[key], (*where, key))


def _opaque(value: Any, where: Path) -> None:
    """Refuse a non-finite number, a non-JSON type or nesting deeper than OPAQUE_DEPTH."""
    stack: list[tuple[Any, int]] = [([value], -1)]  # a list around the root: one loop
    while stack:
        item, depth = stack.pop()
        if depth >= OPAQUE_DEPTH:
            raise SchemaProblem(where, f"nested deeper than {OPAQUE_DEPTH} levels")
        for child in item.values() if isinstance(item, dict) else item:
            kind = type(child)
            if kind is str or kind is int or kind is bool or child is None:
                continue
            if kind is float:
                if child - child != 0.0:  # inf - inf and nan - nan are nan
                    raise SchemaProblem(where, f"holds {child}, which JSON cannot store")
            elif kind is dict or kind is list:
                stack.append((child, depth + 1))
            else:
                _subclass(child, where, stack, depth)


def _subclass(child: Any, where: Path, stack: list[tuple[Any, int]], depth: int) -> None:
    """What a writer handed in that is not a plain JSON type (numpy floats, tuples)."""
    if isinstance(child, float):
        if not math.isfinite(child):
            raise SchemaProblem(where, f"holds {child}, which JSON cannot store")
    elif isinstance(child, dict | list | tuple):
        stack.append((child, depth + 1))
    elif not isinstance(child, str | int):
        raise SchemaProblem(where, f"holds a {type(child).__name__}, which JSON cannot store")


def _must(expected: str, found: Any) -> str:
    return f"must be {expected}, not {describe(found)}"


def _one_of(choices: Any) -> str:
    return "one of " + ", ".join(json.dumps(c) for c in choices)
