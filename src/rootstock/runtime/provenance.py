"""What produced a calculator's results: the checkpoint, its build, its weights, this client.

:func:`build_provenance` reads only what the install already has: the env's
``rootstock-env.json`` (build id, the versions its build probed), its lockfile
``env_source.py.lock`` (hashed, and the versions it resolved) and the manifest's
recorded weight hashes. A ``:custom`` checkpoint's user weights are hashed here
instead, once per calculator. Nothing asks the worker; the device the model ran on
comes from the worker's model report, which the calculator adds.

The lockfile readers are here, not in ``install/``, because the runtime may read
only the install modules docs/architecture.md names; ``rootstock info`` reuses them.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from rootstock.errors import RootstockError
from rootstock.install.envs import load_installed_env, read_env_metadata, recorded_weights
from rootstock.install.parsing import ParseProblem, loads_toml, read_regular_file
from rootstock.version import __version__

if TYPE_CHECKING:
    from rootstock.install.layout import InstallLayout
    from rootstock.runtime.spec import WorkerSpec

ENV_LOCKFILE = "env_source.py.lock"
# A torch env's lockfile is a few MB at most; a larger one is not a lockfile we wrote.
_MAX_LOCK_BYTES = 64 << 20
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")
_HASH_CHUNK = 1 << 20


class Provenance(TypedDict):
    """``RootstockCalculator.provenance``: what produced its results (docs/calculator.md)."""

    checkpoint: str
    env: str
    #: The env build that served it (``rootstock-env.json``); None without metadata.
    build_id: str | None
    #: The sha256 of the build's ``env_source.py.lock``; None for an env built unlocked.
    lockfile_sha256: str | None
    #: Each direct dependency of the env file (the model package among them) and
    #: torch, with the version the build resolved; None where nothing says.
    packages: dict[str, str | None]
    #: ``{path: sha256}`` of the weight files: those ``add`` recorded (paths relative
    #: to the cache root) or the user's own for a ``:custom`` id (absolute paths);
    #: empty when none were recorded.
    weights: dict[str, str]
    rootstock_version: str
    cluster: str | None
    #: The device the model's parameters are on, from the worker's report; None
    #: before the worker started (or when it cannot tell).
    device: str | None


@dataclass(frozen=True)
class EnvLock:
    """A built env's ``env_source.py.lock``: its path, sha256 and resolved versions."""

    path: Path
    sha256: str
    #: ``{normalised package name: [versions]}`` (one per Python at most).
    versions: dict[str, list[str]]


def build_provenance(spec: WorkerSpec, device: str | None = None) -> Provenance:
    """The provenance of results computed for ``spec`` (the model's ``device`` if known).

    Reads the env file, the build's metadata, its lockfile and the manifest once; a
    ``:custom`` checkpoint's user weights are hashed (at disk speed).
    """
    layout = spec.layout
    meta = read_env_metadata(layout, spec.env_name) or {}
    lock = read_env_lock(layout, spec.env_name)
    probed = meta.get("versions")
    try:
        packages = resolved_versions(
            load_installed_env(layout, spec.env_name).dependencies,
            lock,
            probed if isinstance(probed, dict) else {},
        )
    except RootstockError:
        packages = {}  # a hotfix broke env_source.py since the calculator resolved it
    if spec.weights is not None:
        weights = hash_user_weights(spec.weights)
    else:
        weights = {
            path: entry["sha256"]
            for path, entry in recorded_weights(layout, spec.env_name, spec.checkpoint).items()
            if isinstance(entry.get("sha256"), str)
        }
    build_id = meta.get("build_id")
    return {
        "checkpoint": spec.checkpoint,
        "env": spec.env_name,
        "build_id": build_id if isinstance(build_id, str) else None,
        "lockfile_sha256": lock.sha256 if lock is not None else None,
        "packages": packages,
        "weights": weights,
        "rootstock_version": __version__,
        "cluster": spec.cluster,
        "device": device,
    }


def hash_user_weights(path: Path) -> dict[str, str]:
    """``{absolute path: sha256}`` of a weights file, or of every file under a weights
    directory (some families save one), in path order."""
    if not path.is_dir():
        return {str(path): file_sha256(path)}
    found: dict[str, str] = {}
    for directory, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            member = Path(directory, name)
            if member.is_file():
                found[str(member)] = file_sha256(member)
    return found


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_env_lock(layout: InstallLayout, name: str) -> EnvLock | None:
    """The env's lockfile, read once; None when the env was built without one or it
    cannot be read as a uv script lock."""
    path = layout.env_dir(name) / ENV_LOCKFILE
    try:
        raw = read_regular_file(path, _MAX_LOCK_BYTES)
        lock = loads_toml(raw)
    except (OSError, ParseProblem):
        return None
    versions: dict[str, list[str]] = {}
    for package in lock.get("package") or []:
        if isinstance(package, dict) and isinstance(package.get("name"), str):
            version = package.get("version")
            if isinstance(version, str):
                found = versions.setdefault(_normalized(package["name"]), [])
                if version not in found:
                    found.append(version)
    return EnvLock(path, hashlib.sha256(raw).hexdigest(), versions)


def resolved_versions(
    dependencies: list[str], lock: EnvLock | None, probed: dict[str, str]
) -> dict[str, str | None]:
    """Each of an env file's ``dependencies`` (its PEP 723 requirements), and torch,
    with the version its lock resolved.

    Where the lock holds one version per Python, the build's probe (``probed``: the
    ``versions`` of ``rootstock-env.json``) says which is installed; without a lock,
    the probe's version; None when neither knows the package.
    """
    locked = lock.versions if lock is not None else {}
    names = [*(_requirement_name(d) for d in dependencies), "torch"]
    packages: dict[str, str | None] = {}
    for name in dict.fromkeys(n for n in names if n):
        versions = locked.get(name, [])
        if len(versions) == 1:
            packages[name] = versions[0]
        elif probed.get(name) in versions or (not versions and probed.get(name)):
            packages[name] = probed[name]  # the lock's version for this env's Python
        else:
            packages[name] = " or ".join(versions) or None
    return packages


def _requirement_name(requirement: str) -> str | None:
    found = _REQUIREMENT_NAME.match(requirement)
    return _normalized(found.group(1)) if found else None


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
