"""Where things live in an install, and how the root and cache root are found.

Resolution order (every reader uses these two functions, CLI and calculator alike):

* root: ``--root`` / ``root=``, then the cluster registry entry for ``--cluster`` /
  ``cluster=``, then ``$ROOTSTOCK_ROOT``, then ``root`` in config.toml. An explicit
  cluster comes before the defaults because it is the more specific request: a
  default root must never silently send a maintainer to another cluster's tree.
  A cluster name the registry does not know is refused (a usage error listing the
  known names) unless the manifest of the install it resolves to names it.
* cache root: an explicit override, then ``cache_root`` in ``{root}/layout.json``,
  then the registry's legacy ``cache_root`` for the root, then the root itself.

A ``layout.json`` always declares the cache root: ``"cache_root": null`` declares
the root itself. The registry's legacy entry applies only to an install with no
``layout.json`` at all, so a registry shipped by a later client release can never
re-point an install that has declared its own cache root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rootstock.errors import LayoutError, RootNotFound, UsageError
from rootstock.install.atomic import atomic_write_json
from rootstock.install.clusters import (
    Cluster,
    clusters_for_root,
    load_registry,
    unknown_cluster_error,
)
from rootstock.install.config import config_path, load_config
from rootstock.install.parsing import (
    SMALL_FILE_MAX_BYTES,
    ParseProblem,
    absolute_path_problem,
    loads_json,
    read_regular_file,
    type_name,
)

LAYOUT_VERSION = 1
ROOT_ENV = "ROOTSTOCK_ROOT"
_LAYOUT_FORM = f'{{"layout_version": {LAYOUT_VERSION}, "cache_root": "/absolute/path" or null}}'


@dataclass(frozen=True)
class InstallLayout:
    """The paths of one install root and its (possibly separate) cache root."""

    root: Path
    cache_root: Path

    @property
    def layout_file(self) -> Path:
        return self.root / "layout.json"

    @property
    def manifest_file(self) -> Path:
        return self.root / "manifest.json"

    @property
    def environments_dir(self) -> Path:
        return self.root / "environments"

    @property
    def envs_dir(self) -> Path:
        return self.root / "envs"

    @property
    def build_dir(self) -> Path:
        return self.root / ".build"

    @property
    def trash_dir(self) -> Path:
        """Where ``prune`` renames envs before deleting them."""
        return self.root / ".trash"

    @property
    def prune_journal(self) -> Path:
        """``prune``'s intent journal: what it still has to delete (docs/cli.md)."""
        return self.root / ".prune-journal.json"

    @property
    def python_dir(self) -> Path:
        return self.root / ".python"

    @property
    def uv_cache_dir(self) -> Path:
        return self.root / ".uv-cache"

    @property
    def wheels_dir(self) -> Path:
        return self.root / "wheels"

    @property
    def locks_dir(self) -> Path:
        return self.root / ".locks"

    @property
    def home_dir(self) -> Path:
        return self.cache_root / "home"

    @property
    def cache_dir(self) -> Path:
        return self.cache_root / "cache"

    @property
    def usage_dir(self) -> Path:
        return self.cache_root / "usage"

    def env_dir(self, name: str) -> Path:
        return self.envs_dir / name

    def env_source(self, name: str) -> Path:
        return self.envs_dir / name / "env_source.py"

    def env_python(self, name: str) -> Path:
        return self.envs_dir / name / "bin" / "python"

    def registered_source(self, name: str) -> Path:
        return self.environments_dir / f"{name}.py"


@dataclass(frozen=True)
class RootChoice:
    """The install root, and the rule that supplied it (as ``rootstock resolve`` says it)."""

    root: Path
    source: str


def resolve_root(root: str | os.PathLike | None = None, cluster: str | None = None) -> Path:
    """Find the install root: ``root``, then ``cluster``'s registry entry, then the defaults."""
    return choose_root(root, cluster).root


def choose_root(root: str | os.PathLike | None = None, cluster: str | None = None) -> RootChoice:
    """Pick the install root in the documented order and say which rule supplied it.

    An explicit ``root`` always wins; ``cluster`` then names this machine, so an
    unregistered name must be one the install's manifest serves. Without ``root``,
    a registered ``cluster`` supplies its registry root. An unregistered one falls
    through to ``$ROOTSTOCK_ROOT`` and config.toml, and is accepted only if the
    manifest there names it: otherwise a typo would quietly run against whatever
    install the defaults point at.
    """
    if root:
        choice = RootChoice(_absolute(root), "--root")
    else:
        entry = registered_cluster(cluster) if cluster else None
        if entry is not None:
            return RootChoice(entry.root, f"cluster registry ({entry.name})")
        defaults = default_roots()
        if not defaults:
            if cluster:
                raise unknown_cluster_error(cluster)
            raise RootNotFound(
                "no install root given",
                hint=f"pass --root PATH or --cluster NAME, set ${ROOT_ENV}, "
                f"or run `rootstock init` (which records it in {config_path()})",
            )
        choice = defaults[0]
    if cluster:
        check_cluster_known(cluster, choice.root)
    return choice


def default_roots() -> list[RootChoice]:
    """The roots ``$ROOTSTOCK_ROOT`` and config.toml name, in that order (either may be absent)."""
    found = []
    env_root = os.environ.get(ROOT_ENV)
    if env_root:
        found.append(RootChoice(_absolute(env_root), f"${ROOT_ENV}"))
    config_root = load_config().get("root")
    if config_root:
        found.append(RootChoice(_absolute(str(config_root)), f"config ({config_path()})"))
    return found


def registered_cluster(name: str) -> Cluster | None:
    """The registry entry for ``name`` (case-insensitive), or None."""
    return load_registry().get(name.strip().lower())


def check_cluster_known(cluster: str, root: Path) -> None:
    """Refuse ``cluster`` unless the registry or the manifest of ``root`` names it.

    The manifest counts because a shared install that is not in the registry (or
    that the registry knows under another path) lists its machines there.
    """
    if registered_cluster(cluster) is not None:
        return
    served = manifest_clusters(root)
    if cluster.strip().lower() in served:
        return
    raise unknown_cluster_error(cluster, served, root if Path(root).is_dir() else None)


def manifest_clusters(root: Path) -> list[str]:
    """The clusters ``{root}/manifest.json`` names; none when the install has no manifest."""
    # Imported here: the manifest store is built on this module.
    from rootstock.install.manifest import load_manifest

    return list(load_manifest(InstallLayout(Path(root), Path(root)))["clusters"])


def _absolute(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().absolute()


def read_layout(root: Path) -> dict[str, Any] | None:
    """Return ``{root}/layout.json``, or None if the install has none yet.

    Raises :class:`LayoutError` naming the file (and the field) for a file that is
    not a regular file or is over
    :data:`~rootstock.install.parsing.SMALL_FILE_MAX_BYTES`, for text that is not
    UTF-8 JSON, nests too deep, holds NaN, is not an object, has no
    non-negative integer ``layout_version`` or a newer one than this client knows,
    or declares a ``cache_root`` that is neither null nor an absolute path.
    ``written_by`` and ``written_at`` are informational and never read, so their
    values are not checked; nor are keys this version does not know.
    """
    path = Path(root) / "layout.json"
    try:
        data = loads_json(read_regular_file(path, SMALL_FILE_MAX_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ParseProblem) as exc:
        raise LayoutError(
            f"{path} is unreadable: {exc}",
            hint=f"restore it from a backup, or rewrite it by hand as {_LAYOUT_FORM}",
        ) from None
    if not isinstance(data, dict):
        raise LayoutError(
            f"{path} must hold a JSON object, not {type_name(data)}",
            hint=f"restore it from a backup, or rewrite it by hand as {_LAYOUT_FORM}",
        )
    version = data.get("layout_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        if "layout_version" not in data:
            held = ""
        elif isinstance(version, int) and not isinstance(version, bool):
            held = f" (it holds {version}, below 0)"
        else:
            held = f" (it holds {type_name(version)})"
        raise LayoutError(
            f"{path} has no non-negative integer layout_version{held}",
            hint=f'set "layout_version": {LAYOUT_VERSION} (a JSON number, not a string)',
        )
    if version > LAYOUT_VERSION:
        raise LayoutError(
            f"{path} has layout version {version}, but this rootstock understands "
            f"only up to {LAYOUT_VERSION}",
            hint="upgrade rootstock (pip install -U rootstock) to use this install",
        )
    if "cache_root" in data:
        problem = _cache_root_problem(data["cache_root"])
        if problem:
            raise LayoutError(
                f"{path}: cache_root {problem}",
                hint='edit "cache_root" in that file: the absolute path of the cache root '
                "the install uses, or null for the install root itself (`init --force` keeps "
                "a declared cache root, so it cannot repair this; see 'Moving the cache "
                "root later' in docs/cluster-setup.md)",
            )
    return data


def _cache_root_problem(value: object) -> str | None:
    """Why ``value`` cannot be a declared cache root (null or an absolute path), or None."""
    if value is None:
        return None
    # ``~`` would be a different home for every user of a shared install.
    return absolute_path_problem(value)


def write_layout(root: Path, cache_root: str | os.PathLike | None) -> dict[str, Any]:
    """Write a fresh ``layout.json`` declaring ``cache_root`` (None: the root itself).

    Refuses (:class:`LayoutError`, nothing written) a ``cache_root`` that
    :func:`read_layout` would refuse: empty, relative, ``~``-relative, or with NUL.
    """
    from rootstock import __version__

    declared = os.fspath(cache_root) if cache_root is not None else None
    problem = _cache_root_problem(declared)
    if problem:
        raise LayoutError(
            f"refusing to write {Path(root) / 'layout.json'}: cache_root {problem}",
            hint="pass --cache-root as an absolute path",
        )
    data = {
        "layout_version": LAYOUT_VERSION,
        "cache_root": declared,
        "written_by": f"rootstock {__version__}",
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    atomic_write_json(Path(root) / "layout.json", data)
    return data


def resolve_cache_root(
    root: Path, override: str | os.PathLike | None = None, cluster: str | None = None
) -> Path:
    """Find the cache root of ``root`` in the documented order.

    Raises :class:`LayoutError` for a ``layout.json`` that :func:`read_layout`
    refuses, and :class:`~rootstock.errors.UsageError` for an override with NUL.
    """
    if override:
        if "\0" in os.fspath(override):
            raise UsageError(
                "the cache root override contains a NUL character",
                hint="pass --cache-root (or cache_root=) as a plain path",
            )
        return Path(override).expanduser().absolute()
    layout = read_layout(root)
    if layout is not None and "cache_root" in layout:
        declared = layout["cache_root"]
        return Path(declared) if declared is not None else Path(root)
    legacy = _legacy_cache_root(root, cluster)
    if legacy:
        return legacy
    return Path(root)


def _legacy_cache_root(root: Path, cluster: str | None) -> Path | None:
    """The registry's legacy ``cache_root`` for ``root``, if any entry has one."""
    if cluster:
        # ``cluster`` may name an unregistered machine that the install's manifest
        # lists (checked by choose_root), which simply has no registry entry here.
        entry = registered_cluster(cluster)
        if entry and entry.cache_root and os.path.realpath(entry.root) == os.path.realpath(root):
            return entry.cache_root
    for entry in clusters_for_root(root):
        if entry.cache_root:
            return entry.cache_root
    return None


def resolve_layout(
    root: str | os.PathLike | None = None,
    cluster: str | None = None,
    cache_root: str | os.PathLike | None = None,
    must_exist: bool = True,
) -> InstallLayout:
    """Resolve both roots at once; with ``must_exist``, refuse a missing root."""
    resolved = resolve_root(root, cluster)
    if must_exist and not resolved.is_dir():
        raise RootNotFound(
            f"install root {resolved} does not exist",
            hint=f"run `rootstock init --root {resolved}` first, or pass the right --root",
        )
    return InstallLayout(resolved, resolve_cache_root(resolved, cache_root, cluster))


def explain_resolution(
    root: str | os.PathLike | None = None,
    cluster: str | None = None,
    cache_root: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Resolve both roots and say which rule supplied each (for ``rootstock resolve``).

    ``shadowed`` lists the lower-ranked rules that name a *different* root, so a
    maintainer sees at once when, say, ``--cluster`` overrides ``$ROOTSTOCK_ROOT``.
    """
    choice = choose_root(root, cluster)
    resolved = choice.root
    layout = read_layout(resolved) if resolved.is_dir() else None
    if cache_root:
        cache_source = "--cache-root"
    elif layout is not None and "cache_root" in layout:
        cache_source = "layout.json"
    elif _legacy_cache_root(resolved, cluster):
        cache_source = "cluster registry (legacy cache_root)"
    else:
        cache_source = "the install root itself"
    return {
        "root": str(resolved),
        "root_source": choice.source,
        "root_exists": resolved.is_dir(),
        "shadowed": [
            {"source": c.source, "root": str(c.root)} for c in _shadowed(choice, root, cluster)
        ],
        "cache_root": str(resolve_cache_root(resolved, cache_root, cluster)),
        "cache_root_source": cache_source,
        "layout_version": layout.get("layout_version") if layout else None,
        "cluster": cluster,
        "siblings": sorted(c.name for c in clusters_for_root(resolved)),
    }


def _shadowed(
    choice: RootChoice, root: str | os.PathLike | None, cluster: str | None
) -> list[RootChoice]:
    """The rules ranked below ``choice`` that would have picked another root."""
    ranked = []
    if root:
        ranked.append(RootChoice(_absolute(root), "--root"))
    entry = registered_cluster(cluster) if cluster else None
    if entry is not None:
        ranked.append(RootChoice(entry.root, f"cluster registry ({entry.name})"))
    ranked += default_roots()
    sources = [c.source for c in ranked]
    below = ranked[sources.index(choice.source) + 1 :]
    target = os.path.realpath(choice.root)
    return [c for c in below if os.path.realpath(c.root) != target]
