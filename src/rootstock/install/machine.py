"""Which machine this is: the install root, its cache root and the cluster name.

The one place that answers it, for every command, the calculator and the dashboard
push. :func:`resolve_machine` returns a :class:`Machine`: the three answers and the
rule that supplied each. Resolution order:

* root: ``--root`` / ``root=``, then the cluster registry entry for ``--cluster`` /
  ``cluster=``, then ``$ROOTSTOCK_ROOT``, then ``root`` in config.toml. An explicit
  cluster comes before the defaults because it is the more specific request: a
  default root must never silently send a maintainer to another cluster's tree.
  A cluster name the registry does not know is refused (a usage error listing the
  known names) unless the manifest of the install it resolves to names it.
* cache root: an explicit override, then ``cache_root`` in ``{root}/layout.json``,
  then the registry's legacy ``cache_root`` for the root, then the root itself.
* cluster: the explicit name; the calculator then takes ``cluster`` in config.toml
  (``cluster_from_config``). Results are recorded for :func:`resolve_cluster`'s
  answer, which also takes the only cluster the install serves.

A ``layout.json`` always declares the cache root: ``"cache_root": null`` declares
the root itself. The registry's legacy entry applies only to an install with no
``layout.json`` at all, so a registry shipped by a later client release can never
re-point an install that has declared its own cache root.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rootstock.errors import RootNotFound, UsageError
from rootstock.install.clusters import (
    Cluster,
    clusters_for_root,
    load_registry,
    sibling_names,
    unknown_cluster_error,
)
from rootstock.install.config import config_path, load_config
from rootstock.install.layout import ROOT_ENV, InstallLayout, read_layout
from rootstock.install.manifest import Manifest, load_manifest
from rootstock.install.manifest.schema import unique
from rootstock.names import cluster_name

#: Where the root came from: ``--root``/``root=``, the registry entry of the
#: cluster, ``$ROOTSTOCK_ROOT``, or config.toml.
RootSource = Literal["argument", "registry", "environment", "config"]
#: Where the cache root came from: ``--cache-root``/``cache_root=``, layout.json,
#: the registry's legacy entry, or the root itself.
CacheRootSource = Literal["argument", "layout", "registry", "root"]
#: Where the cluster came from: ``--cluster``/``cluster=``, config.toml, or nowhere.
ClusterSource = Literal["argument", "config", "none"]

_CACHE_SOURCE_TEXT: dict[CacheRootSource, str] = {
    "argument": "--cache-root",
    "layout": "layout.json",
    "registry": "cluster registry (legacy cache_root)",
    "root": "the install root itself",
}


@dataclass(frozen=True)
class RootChoice:
    """A root one rule names, and that rule."""

    root: Path
    source: RootSource
    registered: str | None = None  # the registered cluster that supplied it, if one did

    def describe(self) -> str:
        """The rule as ``rootstock resolve`` says it (``cluster registry (della)``)."""
        if self.source == "argument":
            return "--root"
        if self.source == "registry":
            return f"cluster registry ({self.registered})"
        if self.source == "environment":
            return f"${ROOT_ENV}"
        return f"config ({config_path()})"


@dataclass(frozen=True)
class Machine:
    """The install root, cache root and cluster of this machine, and where each came from."""

    root: Path
    cache_root: Path
    cluster: str | None
    root_source: RootSource
    cache_root_source: CacheRootSource
    cluster_source: ClusterSource
    #: The registered cluster whose entry supplied the root, if one did.
    registered: str | None = None

    @property
    def layout(self) -> InstallLayout:
        """The paths of the install."""
        return InstallLayout(self.root, self.cache_root)

    @property
    def root_choice(self) -> RootChoice:
        """The root and its rule."""
        return RootChoice(self.root, self.root_source, self.registered)

    @property
    def cache_root_source_text(self) -> str:
        """The cache root's rule as ``rootstock resolve`` says it."""
        return _CACHE_SOURCE_TEXT[self.cache_root_source]


def resolve_machine(
    root: str | os.PathLike[str] | None = None,
    cluster: str | None = None,
    cache_root: str | os.PathLike[str] | None = None,
    must_exist: bool = True,
    cluster_from_config: bool = False,
) -> Machine:
    """Resolve the root, the cache root and the cluster in the documented order.

    With ``must_exist``, a root that is not a directory is refused, saying which
    rule chose it. With ``cluster_from_config`` (the calculator's rule), no
    ``cluster`` falls back to ``cluster`` in config.toml. Raises
    :class:`~rootstock.errors.RootNotFound`, :class:`~rootstock.errors.UsageError`
    for an unknown cluster, and :class:`~rootstock.errors.LayoutError` for a
    ``layout.json`` that cannot be read.
    """
    choice = choose_root(root, cluster)
    if must_exist and not choice.root.is_dir():
        raise _missing_root(choice)
    cache, cache_source = _choose_cache_root(choice.root, cache_root, cluster)
    name: str | None = cluster
    name_source: ClusterSource = "argument" if cluster else "none"
    if not cluster and cluster_from_config:
        name = configured_cluster()
        name_source = "config" if name else "none"
    return Machine(
        root=choice.root,
        cache_root=cache,
        cluster=name or None,
        root_source=choice.source,
        cache_root_source=cache_source,
        cluster_source=name_source,
        registered=choice.registered,
    )


def resolve_layout(
    root: str | os.PathLike[str] | None = None,
    cluster: str | None = None,
    cache_root: str | os.PathLike[str] | None = None,
    must_exist: bool = True,
) -> InstallLayout:
    """Resolve both roots at once; with ``must_exist``, refuse a missing root."""
    return resolve_machine(root, cluster, cache_root, must_exist).layout


def resolve_root(root: str | os.PathLike[str] | None = None, cluster: str | None = None) -> Path:
    """Find the install root: ``root``, then ``cluster``'s registry entry, then the defaults."""
    return choose_root(root, cluster).root


def first_root(
    root: str | os.PathLike[str] | None = None, cluster: str | None = None
) -> RootChoice | None:
    """The root the documented order picks, or None; the cluster is not checked.

    ``init`` offers it, since init is how a new machine gets recorded.
    """
    if root:
        return RootChoice(_absolute(root), "argument")
    entry = registered_cluster(cluster) if cluster else None
    if entry is not None:
        return RootChoice(entry.root, "registry", entry.name)
    defaults = default_roots()
    return defaults[0] if defaults else None


def choose_root(
    root: str | os.PathLike[str] | None = None, cluster: str | None = None
) -> RootChoice:
    """Pick the install root in the documented order and say which rule supplied it.

    An explicit ``root`` always wins; ``cluster`` then names this machine, so an
    unregistered name must be one the install's manifest serves. Without ``root``,
    a registered ``cluster`` supplies its registry root. An unregistered one falls
    through to ``$ROOTSTOCK_ROOT`` and config.toml, and is accepted only if the
    manifest there names it: otherwise a typo would quietly run against whatever
    install the defaults point at.
    """
    choice = first_root(root, cluster)
    if choice is None:
        if cluster:
            raise unknown_cluster_error(cluster)
        rest = f"set ${ROOT_ENV}, or run `rootstock init` (which records it in {config_path()})"
        raise RootNotFound(
            "no install root given",
            hint=f"pass root=PATH or cluster=NAME, {rest}",
            cli_hint=f"pass --root PATH or --cluster NAME, {rest}",
        )
    if cluster and choice.source != "registry":
        check_cluster_known(cluster, choice.root)
    return choice


def default_roots() -> list[RootChoice]:
    """The roots ``$ROOTSTOCK_ROOT`` and config.toml name, in that order (either may be absent)."""
    found = []
    env_root = os.environ.get(ROOT_ENV)
    if env_root:
        found.append(RootChoice(_absolute(env_root), "environment"))
    config_root = load_config().get("root")
    if config_root:
        found.append(RootChoice(_absolute(str(config_root)), "config"))
    return found


def configured_cluster() -> str | None:
    """The ``cluster`` recorded in config.toml, if any."""
    value = load_config().get("cluster")
    return value if isinstance(value, str) and value else None


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
    return list(load_manifest(InstallLayout(Path(root), Path(root)))["clusters"])


def _absolute(path: str | os.PathLike[str]) -> Path:
    return Path(path).expanduser().absolute()


def resolve_cache_root(
    root: Path, override: str | os.PathLike[str] | None = None, cluster: str | None = None
) -> Path:
    """Find the cache root of ``root`` in the documented order.

    Raises :class:`~rootstock.errors.LayoutError` for a ``layout.json`` that
    :func:`~rootstock.install.layout.read_layout` refuses, and
    :class:`~rootstock.errors.UsageError` for an override with NUL.
    """
    return _choose_cache_root(root, override, cluster)[0]


def _choose_cache_root(
    root: Path, override: str | os.PathLike[str] | None, cluster: str | None
) -> tuple[Path, CacheRootSource]:
    """The cache root of ``root`` and the rule that supplied it."""
    if override:
        if "\0" in os.fspath(override):
            raise UsageError(
                "the cache root override contains a NUL character",
                hint="pass --cache-root (or cache_root=) as a plain path",
            )
        return Path(override).expanduser().absolute(), "argument"
    layout = read_layout(root)
    if layout is not None and "cache_root" in layout:
        declared = layout["cache_root"]
        return (Path(declared) if declared is not None else Path(root)), "layout"
    legacy = _legacy_cache_root(root, cluster)
    if legacy:
        return legacy, "registry"
    return Path(root), "root"


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


def _missing_root(choice: RootChoice) -> RootNotFound:
    """The error for a chosen root that does not exist, saying what chose it.

    A registered cluster's root comes before ``$ROOTSTOCK_ROOT`` and config.toml, so
    a user whose own root is fine is told that the cluster chose this one, and how
    to pick another, before being offered to create it.
    """
    root = choice.root
    create = f"`rootstock init --root {root}`"
    name = choice.registered
    if name is None:
        return RootNotFound(
            f"install root {root} does not exist",
            hint=f"run {create} first, or pass the right root=",
            cli_hint=f"run {create} first, or pass the right --root",
        )
    others = [c for c in default_roots() if os.path.realpath(c.root) != os.path.realpath(root)]
    instead = f" ({others[0].describe()} names {others[0].root})" if others else ""
    why = "the cluster registry's root for it comes before $ROOTSTOCK_ROOT and config.toml"
    return RootNotFound(
        f"install root {root} does not exist",
        hint=f"cluster={name!r} chose it ({why}); pass root=PATH to use another "
        f"install{instead}, or create this one with {create}",
        cli_hint=f"--cluster {name} chose it ({why}); pass --root PATH to use another "
        f"install{instead}, or create this one with {create}",
    )


def explain_resolution(
    root: str | os.PathLike[str] | None = None,
    cluster: str | None = None,
    cache_root: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The :class:`Machine` and which rule supplied each part (``rootstock resolve --json``).

    ``shadowed`` lists the lower-ranked rules that name a *different* root, so a
    maintainer sees at once when, say, ``--cluster`` overrides ``$ROOTSTOCK_ROOT``.
    """
    machine = resolve_machine(root, cluster, cache_root, must_exist=False)
    resolved = machine.root
    exists = resolved.is_dir()
    layout = read_layout(resolved) if exists else None
    return {
        "root": str(resolved),
        "root_source": machine.root_choice.describe(),
        "root_exists": exists,
        "shadowed": [
            {"source": c.describe(), "root": str(c.root)}
            for c in _shadowed(machine.root_choice, root, cluster)
        ],
        "cache_root": str(machine.cache_root),
        "cache_root_source": machine.cache_root_source_text,
        "layout_version": layout.get("layout_version") if layout else None,
        "cluster": machine.cluster,
        "siblings": sibling_names(resolved),
    }


def _shadowed(
    choice: RootChoice, root: str | os.PathLike[str] | None, cluster: str | None
) -> list[RootChoice]:
    """The rules ranked below ``choice`` that would have picked another root."""
    ranked = []
    if root:
        ranked.append(RootChoice(_absolute(root), "argument"))
    entry = registered_cluster(cluster) if cluster else None
    if entry is not None:
        ranked.append(RootChoice(entry.root, "registry", entry.name))
    ranked += default_roots()
    sources = [c.source for c in ranked]
    below = ranked[sources.index(choice.source) + 1 :]
    target = os.path.realpath(choice.root)
    return [c for c in below if os.path.realpath(c.root) != target]


# --- the cluster of an install ------------------------------------------------


def default_cluster_name() -> str:
    """The host's short name: what a cluster is called when nobody says otherwise."""
    return socket.gethostname().split(".")[0].lower() or "local"


def suggest_cluster(root: Path) -> str:
    """The cluster name to offer for ``root``: the manifest's, the registry's, or the host's.

    ``init`` offers it at its prompt, and ``install`` names the manifest it creates
    on a root that ``init`` never saw with it.
    """
    served = manifest_clusters(root)
    if served:
        return str(served[0])
    registered = clusters_for_root(root)
    return registered[0].name if registered else default_cluster_name()


def served_clusters(layout: InstallLayout, manifest: Manifest | None = None) -> list[str]:
    """The clusters this install serves: the manifest's list plus registry siblings."""
    data = manifest if manifest is not None else load_manifest(layout)
    return unique([*data["clusters"], *sibling_names(layout.root)])


def resolve_cluster(
    layout: InstallLayout, cluster: str | None, manifest: Manifest | None = None
) -> str:
    """The machine verification results are recorded for.

    A single-cluster install needs no name; a shared install refuses without one,
    and a name the install does not serve is refused with the way to add it.
    """
    served = served_clusters(layout, manifest)
    if cluster:
        name = cluster_name(cluster)
        if served and name not in served:
            raise UsageError(
                f"this install does not serve cluster {name!r} (it serves {', '.join(served)})",
                hint=f"pass one of those, or add it: rootstock manifest init --cluster {name}",
            )
        return name
    if len(served) == 1:
        return served[0]
    if not served:
        raise UsageError(
            "this install's manifest names no cluster, so results cannot be attributed",
            hint="pass --cluster NAME, or run `rootstock manifest init --cluster NAME`",
        )
    raise UsageError(
        f"this install serves several clusters ({', '.join(served)}); say which machine this is",
        hint="pass --cluster NAME",
    )
