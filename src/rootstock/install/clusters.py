"""The cluster registry: a name -> install-root bootstrap.

Users say ``cluster="perlmutter"`` instead of remembering a path. An entry's
``cache_root`` is only the legacy fallback for installs that predate the
``layout.json`` declaration. The built-in entries ship as data
(``clusters.toml`` beside this module); sites extend or override them with a
TOML file of the same form named by ``$ROOTSTOCK_CLUSTERS_FILE``::

    [clusters.mybox]
    root = "/shared/rootstock"
    cache_root = "/scratch/rootstock-cache"   # optional, legacy fallback only
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rootstock import names
from rootstock.errors import ConfigError, UsageError
from rootstock.install.parsing import (
    SMALL_FILE_MAX_BYTES,
    ParseProblem,
    absolute_path_problem,
    loads_toml,
    read_regular_file,
)

CLUSTERS_FILE_ENV = "ROOTSTOCK_CLUSTERS_FILE"
_ENTRY_FORM = 'each entry is [clusters.NAME] with root = "/path" and an optional cache_root'


@dataclass(frozen=True)
class Cluster:
    """One registered machine: where its install root lives."""

    name: str
    root: Path
    cache_root: Path | None = None


#: The built-in entries, shipped in the wheel beside this module.
BUILTIN_CLUSTERS_FILE = Path(__file__).with_name("clusters.toml")


@functools.cache
def builtin_clusters() -> dict[str, Cluster]:
    """The built-in entries, read once on first use (not at import: every command
    imports this module, and most never look at the registry). Do not modify it."""
    return read_registry_file(BUILTIN_CLUSTERS_FILE)


def load_registry() -> dict[str, Cluster]:
    """Return the built-in clusters, extended or overridden by the site file.

    Raises :class:`ConfigError` naming the file for one that is missing, not a
    regular file, over :data:`~rootstock.install.parsing.SMALL_FILE_MAX_BYTES`, not
    UTF-8, not TOML, nested too deep, or has an entry whose ``root`` (or
    ``cache_root``) is not an absolute path string. An entry whose name breaks
    the cluster-name rule is skipped with a
    :class:`~rootstock.names.StoredNameWarning`: no command could name it.
    """
    registry = dict(builtin_clusters())
    path_text = os.environ.get(CLUSTERS_FILE_ENV)
    if not path_text:
        return registry
    path = Path(path_text).expanduser()
    try:
        registry.update(read_registry_file(path))
    except FileNotFoundError:
        raise ConfigError(
            f"{CLUSTERS_FILE_ENV} names {path}, which does not exist",
            hint=f"create it or unset {CLUSTERS_FILE_ENV}",
        ) from None
    return registry


def read_registry_file(path: Path) -> dict[str, Cluster]:
    """The entries of one registry file (the shipped one, or a site's), by name.

    Raises :class:`FileNotFoundError` for a missing file, and :class:`ConfigError`
    as :func:`load_registry` says.
    """
    try:
        data = loads_toml(read_regular_file(path, SMALL_FILE_MAX_BYTES))
    except FileNotFoundError:
        raise
    except (OSError, ParseProblem) as exc:
        raise ConfigError(
            f"cannot read the cluster registry {path}: {exc}",
            hint=f"fix the file (UTF-8 TOML); {_ENTRY_FORM}",
        ) from None
    entries = data.get("clusters", {})
    if not isinstance(entries, dict):
        raise ConfigError(f"{path}: [clusters] must be a table of tables", hint=_ENTRY_FORM)
    registry: dict[str, Cluster] = {}
    from_file: dict[str, str] = {}
    for name, entry in entries.items():
        cluster = _registry_entry(path, name, entry)
        if cluster is None:
            continue
        if cluster.name in from_file:
            raise ConfigError(
                f"{path}: [clusters.{from_file[cluster.name]}] and [clusters.{name}] "
                f"both name cluster {cluster.name!r} (names are case-insensitive)",
                hint="keep one of the two entries",
            )
        from_file[cluster.name] = name
        registry[cluster.name] = cluster
    return registry


def _registry_entry(path: Path, name: str, entry: object) -> Cluster | None:
    """One ``[clusters.NAME]`` table as a :class:`Cluster`; None for a skipped name."""
    if not isinstance(entry, dict) or "root" not in entry:
        raise ConfigError(
            f'{path}: [clusters.{name}] needs root = "/path"',
            hint="add a root key with the install root of that cluster",
        )
    # Shared by every user of the site, so no ``~``: it would be a different home each.
    for key in ("root", "cache_root"):
        if key not in entry:
            continue
        problem = absolute_path_problem(entry[key])
        if problem:
            raise ConfigError(
                f"{path}: [clusters.{name}] {key} {problem}",
                hint=f'write {key} = "/absolute/path" ({_ENTRY_FORM})',
            )
    if not names.is_cluster_name(name.strip().lower()):
        names.warn_stored_name(
            "cluster name",
            name,
            f"the cluster registry {path}",
            f"the entry is skipped; rename it ({names.CLUSTER_NAME_RULE})",
        )
        return None
    cache = entry.get("cache_root")
    return Cluster(
        name.strip().lower(), Path(entry["root"]), Path(cache) if cache is not None else None
    )


def get_cluster(name: str) -> Cluster:
    """Look up ``name`` (case-insensitive), raising with the known names if absent."""
    entry = load_registry().get(name.strip().lower())
    if entry is None:
        raise unknown_cluster_error(name)
    return entry


def unknown_cluster_error(
    name: str, served: Iterable[str] = (), root: Path | None = None
) -> UsageError:
    """The usage error for a cluster name nobody knows, listing every name that is known.

    ``served`` are the names the manifest of the install at ``root`` lists: they are
    as valid as registered ones, so they are listed too. ``root`` is None when no
    install was found to ask.
    """
    known = ", ".join(sorted({*load_registry(), *served}))
    hint = f"pass one of those, or register the cluster in ${CLUSTERS_FILE_ENV}"
    if root is not None:
        hint += (
            f", or add it to the install at {root}: "
            f"rootstock manifest init --root {root} --cluster {name.strip().lower()}"
        )
    else:
        hint += ", or pass --root PATH of an install whose manifest names it"
    return UsageError(f"unknown cluster {name!r}; known clusters: {known}", hint=hint)


def clusters_for_root(root: Path) -> list[Cluster]:
    """Every registered cluster whose install root is ``root`` (siblings included)."""
    target = _norm(root)
    return [c for c in load_registry().values() if _norm(c.root) == target]


def sibling_names(root: Path) -> list[str]:
    """The names of every registered cluster whose install root is ``root``, sorted."""
    return sorted(c.name for c in clusters_for_root(root))


def _norm(path: Path) -> str:
    return os.path.realpath(os.path.expanduser(str(path)))
