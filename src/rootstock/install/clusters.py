"""The cluster registry: a name -> install-root bootstrap.

Users say ``cluster="perlmutter"`` instead of remembering a path. An entry's
``cache_root`` is only the legacy fallback for installs that predate the
``layout.json`` declaration. Sites extend or override the built-in entries with a
TOML file named by ``$ROOTSTOCK_CLUSTERS_FILE``::

    [clusters.mybox]
    root = "/shared/rootstock"
    cache_root = "/scratch/rootstock-cache"   # optional, legacy fallback only
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rootstock.errors import ConfigError, UsageError

CLUSTERS_FILE_ENV = "ROOTSTOCK_CLUSTERS_FILE"


@dataclass(frozen=True)
class Cluster:
    """One registered machine: where its install root lives."""

    name: str
    root: Path
    cache_root: Path | None = None


_EAGLE_ROOT = Path("/lus/eagle/projects/rootstock/rootstock")

BUILTIN_CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        Cluster("della", Path("/scratch/gpfs/ROOTSTOCK/rootstock")),
        Cluster("delta", Path("/projects/bhhl/rootstock")),
        # Sophia and Polaris mount the same Eagle filesystem and share one install.
        Cluster("sophia", _EAGLE_ROOT),
        Cluster("polaris", _EAGLE_ROOT),
        Cluster(
            "perlmutter",
            Path("/global/cfs/cdirs/m5268/rootstock"),
            cache_root=Path("/pscratch/sd/o/oprice/rootstock-cache"),
        ),
        Cluster("aurora", Path("/lus/flare/projects/rootstock/rootstock")),
    )
}


def load_registry() -> dict[str, Cluster]:
    """Return the built-in clusters, extended or overridden by the site file."""
    registry = dict(BUILTIN_CLUSTERS)
    path_text = os.environ.get(CLUSTERS_FILE_ENV)
    if not path_text:
        return registry
    path = Path(path_text).expanduser()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{CLUSTERS_FILE_ENV} names {path}, which does not exist",
            hint=f"create it or unset {CLUSTERS_FILE_ENV}",
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            f"cannot read the cluster registry {path}: {exc}",
            hint='fix the TOML; each entry is [clusters.NAME] with root = "/path"',
        ) from None
    entries = data.get("clusters", {})
    if not isinstance(entries, dict):
        raise ConfigError(f"{path}: [clusters] must be a table of tables")
    for name, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("root"), str):
            raise ConfigError(
                f'{path}: [clusters.{name}] needs root = "/path"',
                hint="add a root key with the install root of that cluster",
            )
        cache = entry.get("cache_root")
        registry[name.lower()] = Cluster(
            name.lower(), Path(entry["root"]), Path(cache) if isinstance(cache, str) else None
        )
    return registry


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


def _norm(path: Path) -> str:
    return os.path.realpath(os.path.expanduser(str(path)))
