"""One-record writes: an env build, a fetch, a verification outcome.

Each helper is one short locked read-modify-write (:func:`.store.update_manifest`)
that touches only its own record, so a smoke-test killed at its wall-time limit
keeps every stamp it reached, and concurrent ``add``/``smoke-test``/``install``
processes never lose each other's updates. Do the slow work (download, forward
pass) first, then call these.
"""

from __future__ import annotations

import copy
import os
import secrets
from typing import Any, cast

from rootstock.errors import UnstorableValue, UsageError
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest.fingerprints import (
    UNRECORDED_KWARGS,
    FingerprintTolerance,
    canonical_kwargs,
    compare_fingerprints,
    device_kind,
    kwargs_key,
)
from rootstock.install.manifest.schema import (
    ENV_BUILD_FIELDS,
    STAGED_MODES,
    utc_now,
)
from rootstock.install.manifest.store import DEFAULT_LOCK_TIMEOUT, update_manifest
from rootstock.install.manifest.types import (
    BuildRef,
    CheckpointRecord,
    Checks,
    EnvRecord,
    Fingerprint,
    ImageRecord,
    JsonObject,
    Manifest,
    Reference,
    Verification,
    VerificationState,
    WeightFile,
)
from rootstock.install.manifest.validate import (
    DEVICE_KINDS,
    MAX_CHECKPOINT_FILES,
    cache_path_problem,
    image_problem,
    opaque_problem,
    weights_problem,
)
from rootstock.names import cluster_name, device_name

MESSAGE_MAX = 300


def record_env_build(
    layout: InstallLayout,
    env_name: str,
    build_info: dict[str, Any],
    timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> EnvRecord:
    """Record a finished (re)build of ``env_name``; return the env's build fields.

    ``build_info`` holds :data:`ENV_BUILD_FIELDS` (``source_hash`` required;
    ``built_at`` defaults to now, ``build_id`` to a fresh random token that tells
    this build from any other even within one second; others default to None).
    ``image`` is the build's squashfs image, ``{file, sha256, size, compression}``
    (:class:`~.types.ImageRecord`), or None for a build without one; a malformed
    one raises ``ValueError`` before the lock is taken. Checkpoint records are
    kept: their verifications now point at an older build, so they show as stale
    until re-verified, and re-verification compares with their reference fingerprint.
    """
    unknown = set(build_info) - set(ENV_BUILD_FIELDS)
    if unknown:
        raise ValueError(f"unknown env build fields: {sorted(unknown)}")
    if not build_info.get("source_hash"):
        raise ValueError("build_info needs a source_hash")
    problem = image_problem(build_info.get("image"))
    if problem:
        raise ValueError(f"build_info['image']: {problem}")
    get = build_info.get
    # A copy: the caller's dict must not alias the record that is written.
    image: ImageRecord | None = copy.deepcopy(get("image"))
    fields: EnvRecord = {
        "build_id": get("build_id") or secrets.token_hex(8),
        "source_hash": get("source_hash"),
        "lock_hash": get("lock_hash"),
        "built_at": get("built_at") or utc_now(),
        "python": get("python"),
        "python_path": get("python_path"),
        "torch": get("torch"),
        "rootstock": get("rootstock"),
        "image": image,
    }

    def mutate(data: Manifest) -> EnvRecord:
        _env_entry(data, env_name).update(fields)
        return copy.deepcopy(fields)

    return update_manifest(layout, mutate, timeout)


def forget_env(layout: InstallLayout, env_name: str, timeout: float = DEFAULT_LOCK_TIMEOUT) -> bool:
    """Drop an env and all its checkpoint records; True if it was recorded."""
    return update_manifest(
        layout, lambda data: data["envs"].pop(env_name, None) is not None, timeout
    )


def record_fetch(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    at: str | None = None,
    timeout: float = DEFAULT_LOCK_TIMEOUT,
    files: list[str] | None = None,
    weights: dict[str, WeightFile] | None = None,
) -> CheckpointRecord:
    """Stamp ``checkpoint`` (served by ``env_name``) as fetched; return its record.

    ``files`` are what the download brought, relative to the cache root (see
    :func:`rootstock.ops.add.download_and_record`). They are merged with the files
    the record already lists that still exist (``lexists``), so a re-download
    never orphans what an earlier one attributed; the result is sorted and
    de-duplicated. ``None`` leaves the record's ``files`` as they are (absent:
    unattributed). A path that is not a clean relative one raises ``ValueError``
    before the lock is taken; a union of more than
    :data:`~.validate.MAX_CHECKPOINT_FILES` drops ``files`` (unattributed) instead
    of refusing the stamp.

    ``weights`` (size, sha256 and mtime of files just fetched) replace the entries of
    those paths; entries of paths the record no longer lists are dropped, and so is
    ``weights`` with ``files``. A malformed one raises ``ValueError`` before the lock.
    """
    stamp = at or utc_now()
    if files is not None:
        for path in files:
            problem = cache_path_problem(path)
            if problem:
                raise ValueError(f"files: {path!r} {problem}")
    _check_weights_arg(weights)
    cache_root = layout.cache_root

    def mutate(data: Manifest) -> CheckpointRecord:
        entry = _checkpoint_entry(_env_entry(data, env_name), checkpoint)
        entry["fetched_at"] = stamp
        if files is not None:
            kept = [p for p in entry.get("files", []) if os.path.lexists(cache_root / p)]
            merged = sorted({*kept, *files})
            if len(merged) <= MAX_CHECKPOINT_FILES:
                entry["files"] = merged
            else:
                entry.pop("files", None)
        _merge_weights(entry, weights or {}, ())
        return copy.deepcopy(entry)

    return update_manifest(layout, mutate, timeout)


def record_weights(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    weights: dict[str, WeightFile],
    dropped: list[str] | tuple[str, ...] = (),
    timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> CheckpointRecord:
    """Record the weight files of a fetched ``checkpoint``: ``add`` accepting the files
    on disk, or a verification refreshing the mtime of a file whose bytes it re-hashed.

    ``weights`` replace the entries of their paths, ``dropped`` paths lose theirs (a
    listed file that is gone); paths the record's ``files`` do not list are ignored.
    A record without ``files`` (unattributed) gets no ``weights``. A malformed one
    raises ``ValueError`` before the lock is taken.
    """
    _check_weights_arg(weights)

    def mutate(data: Manifest) -> CheckpointRecord:
        entry = _checkpoint_entry(_env_entry(data, env_name), checkpoint)
        _merge_weights(entry, weights, dropped)
        return copy.deepcopy(entry)

    return update_manifest(layout, mutate, timeout)


def _check_weights_arg(weights: dict[str, WeightFile] | None) -> None:
    if weights is None:
        return
    problem = weights_problem(weights)
    if problem:
        raise ValueError(f"weights: {problem}")


def _merge_weights(
    entry: CheckpointRecord, weights: dict[str, WeightFile], dropped: list[str] | tuple[str, ...]
) -> None:
    """``entry``'s weights with ``weights`` merged in, ``dropped`` and unlisted paths out."""
    listed = entry.get("files")
    if listed is None:
        entry.pop("weights", None)
        return
    keep = set(listed) - set(dropped)
    merged = {**entry.get("weights", {}), **copy.deepcopy(weights)}
    kept = {path: merged[path] for path in sorted(merged) if path in keep}
    if kept or "weights" in entry or weights:
        entry["weights"] = kept


def record_verification(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    cluster: str,
    result: dict[str, Any],
    accept_drift: bool = False,
    tolerance: FingerprintTolerance | None = None,
    timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> Verification:
    """Record one verification outcome on ``cluster`` and return the stored record.

    ``result`` keys: ``passed`` (bool, required); ``device`` (default ``"cpu"``;
    a device string of :func:`rootstock.names.device_name`, else
    :class:`~rootstock.errors.UsageError`); ``device_kind`` (default derived from
    ``device``; cpu, gpu or xpu); ``staged`` (how the worker was started:
    ``"mount"`` or ``"copy"``, or None, the default, for the shared env; anything
    else raises ``ValueError``); ``fingerprint`` (required
    when passed); ``message`` (why it failed; kept to one line); ``at`` (default
    now); ``kwargs`` (the setup kwargs the pass ran with; default none);
    ``checks`` (the physics checks of :mod:`rootstock.ops.consistency`, stored
    as given; a failed check arrives as ``passed=False``); ``build`` (the env's
    ``build_id``/``source_hash``/``built_at``/``lock_hash``
    as the worker ran it, captured before it started: ``source_hash`` from the live
    ``env_source.py``; missing fields default to the env's recorded build). A
    ``build.source_hash`` also refreshes the env's recorded ``source_hash`` (unless
    the ``build_id`` says a rebuild has happened since), so a hotfix is recorded
    once it has been verified. ``tampered`` (with ``passed`` False) records the state
    ``tampered``: a weight file changed since ``add``, so the model never ran.

    A pass is compared with the reference fingerprint for the same cluster, device
    kind and kwargs: within tolerance it is ``verified``, beyond it ``drifted``. The
    first pass with those kwargs on a device kind sets their reference;
    ``accept_drift`` replaces it (and no other). A reference migrated from schema 1,
    which never said its kwargs, is adopted by the first pass that has none of its
    own, as schema 1 would have compared them.

    A NaN or an infinity in ``fingerprint``, ``checks`` or ``kwargs``, or a value
    JSON cannot hold in the first two, raises
    :class:`~rootstock.errors.UnstorableValue` before the lock is taken; nothing is
    written.
    """
    if not isinstance(result.get("passed"), bool):
        raise ValueError("result['passed'] must be True or False")
    passed = result["passed"]
    tampered = bool(result.get("tampered"))
    if tampered and passed:
        raise ValueError("a tampered verification cannot have passed")
    fingerprint: Fingerprint | None = result.get("fingerprint")
    if passed and not isinstance(fingerprint, dict):
        raise ValueError("a passed verification needs its fingerprint")
    # What a pass measured (the same object as ``fingerprint``); only read on a pass.
    measured: Fingerprint = fingerprint if isinstance(fingerprint, dict) else {}
    # A name stored now is refused later (rootstock.names): refuse it here instead.
    device = device_name(str(result.get("device") or "cpu"))
    kind = str(result.get("device_kind") or device_kind(device))
    if kind not in DEVICE_KINDS:
        raise UsageError(f"{kind!r} is not a device kind", hint="device kinds are cpu, gpu and xpu")
    staged = result.get("staged")
    if staged is not None and staged not in STAGED_MODES:
        raise ValueError(f"result['staged'] must be one of {STAGED_MODES} or None, not {staged!r}")
    at = result.get("at") or utc_now()
    message = one_line(result.get("message"))
    checks: Checks | None = result.get("checks")
    if checks is not None and not isinstance(checks, dict):
        raise ValueError("result['checks'] must be a dict or None")
    build_given = dict(result.get("build") or {})
    machine = cluster_name(cluster)
    kwargs = result.get("kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("result['kwargs'] must be a dict or None")
    for field in ("fingerprint", "checks"):
        _refuse_unstorable(layout, field, result.get(field))
    # Canonical first: a kwarg JSON has no type for (a path) is stored as its text.
    kwargs = canonical_kwargs(kwargs)
    _refuse_unstorable(layout, "kwargs", kwargs)
    key = kwargs_key(kwargs)

    def mutate(data: Manifest) -> Verification:
        env = _env_entry(data, env_name)
        same_build = build_given.get("build_id") in (None, env.get("build_id"))
        if build_given.get("source_hash") and same_build:
            env["source_hash"] = build_given["source_hash"]
        given = build_given.get
        build: BuildRef = {
            "build_id": given("build_id", env.get("build_id")),
            "source_hash": given("source_hash", env.get("source_hash")),
            "built_at": given("built_at", env.get("built_at")),
            "lock_hash": given("lock_hash", env.get("lock_hash")),
        }
        entry = _checkpoint_entry(env, checkpoint)
        by_kind = entry["verifications"].setdefault(machine, {})
        previous = by_kind.get(kind)
        references: dict[str, Reference] = copy.deepcopy(
            (previous.get("references") if previous else None) or {}
        )
        reference = references.get(key)
        unrecorded = reference is None and UNRECORDED_KWARGS in references
        if unrecorded:
            reference = references[UNRECORDED_KWARGS]
        state: VerificationState = "tampered" if tampered else "failed"
        drift: JsonObject | None = None
        note = message
        if passed:
            if unrecorded:
                # Only a pass adopts it, so a failure leaves it for the next pass.
                del references[UNRECORDED_KWARGS]
            if reference is None or accept_drift:
                reference = {"fingerprint": measured, "at": at, "build": build, "kwargs": kwargs}
                state = "verified"
            else:
                comparison = compare_fingerprints(reference["fingerprint"], measured, tolerance)
                state = "verified" if comparison.within else "drifted"
                if not comparison.within:
                    drift, note = comparison.to_dict(), one_line(comparison.message)
            reference.setdefault("kwargs", kwargs)
            references[key] = reference
            if entry.get("fetched_at") is None:
                entry["fetched_at"] = at  # a pass proves the weights are in the cache
        record: Verification = {
            "state": state,
            "at": at,
            "device": device,
            "device_kind": kind,
            "staged": staged,
            "message": note,
            "kwargs": kwargs,
            "fingerprint": fingerprint if passed else None,
            # The reference this pass was judged against (its kwargs' own), and every
            # kwargs' reference on this cluster and kind, kept through failures.
            "reference": reference,
            "references": references,
            "drift": drift,
            # None when nothing could be checked; records from before checks lack it.
            "checks": copy.deepcopy(checks),
            "build": build,
        }
        by_kind[kind] = record
        if machine not in data["clusters"]:
            data["clusters"].append(machine)
        return copy.deepcopy(record)

    return update_manifest(layout, mutate, timeout)


def _refuse_unstorable(layout: InstallLayout, field: str, value: Any) -> None:
    """Refuse NaN, an infinity or a non-JSON value in a result before taking the lock."""
    problem = opaque_problem(value)
    if problem:
        raise UnstorableValue(
            f"refusing to record a verification in {layout.manifest_file}: "
            f"result[{field!r}] {problem}",
            hint="nothing was written: the manifest is as it was",
        )


def one_line(message: Any) -> str | None:
    """The first non-empty line of ``message``, at most :data:`MESSAGE_MAX` characters."""
    if message is None:
        return None
    for line in str(message).splitlines():
        if line.strip():
            text = line.strip()
            return text if len(text) <= MESSAGE_MAX else text[: MESSAGE_MAX - 1] + "…"
    return None


def _env_entry(data: Manifest, env_name: str) -> EnvRecord:
    env = data["envs"].get(env_name)
    if env is None:
        # An env recorded before its build (a manifest made after `install`):
        # unknown build fields are null until the next `install` records them.
        env = cast(EnvRecord, dict.fromkeys(ENV_BUILD_FIELDS))  # every build field, null
        data["envs"][env_name] = env
    env.setdefault("checkpoints", {})
    return env


def _checkpoint_entry(env: EnvRecord, checkpoint: str) -> CheckpointRecord:
    entry = env["checkpoints"].setdefault(checkpoint, {})
    entry.setdefault("fetched_at", None)
    entry.setdefault("verifications", {})
    return entry
