"""Where things live in an install, and how the root and cache root are found.

Resolution order (every reader uses these two functions, CLI and calculator alike):

* root: ``--root`` / ``root=``, then ``$ROOTSTOCK_ROOT``, then ``root`` in
  config.toml, then the cluster registry entry for ``--cluster`` / ``cluster=``.
* cache root: an explicit override, then ``cache_root`` in ``{root}/layout.json``,
  then the registry's legacy ``cache_root`` for the root, then the root itself.

A ``layout.json`` always declares the cache root: ``"cache_root": null`` declares
the root itself. The registry's legacy entry applies only to an install with no
``layout.json`` at all, so a registry shipped by a later client release can never
re-point an install that has declared its own cache root.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rootstock.errors import LayoutError, RootNotFound
from rootstock.install.atomic import atomic_write_json
from rootstock.install.clusters import clusters_for_root, get_cluster, load_registry
from rootstock.install.config import config_path, load_config

LAYOUT_VERSION = 1
ROOT_ENV = "ROOTSTOCK_ROOT"


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


def resolve_root(root: str | os.PathLike | None = None, cluster: str | None = None) -> Path:
    """Find the install root; ``cluster`` supplies it only when nothing else does."""
    if root:
        return Path(root).expanduser().absolute()
    env_root = os.environ.get(ROOT_ENV)
    if env_root:
        return Path(env_root).expanduser().absolute()
    config_root = load_config().get("root")
    if config_root:
        return Path(str(config_root)).expanduser().absolute()
    if cluster:
        return get_cluster(cluster).root
    raise RootNotFound(
        "no install root given",
        hint=f"pass --root PATH or --cluster NAME, set ${ROOT_ENV}, "
        f"or run `rootstock init` (which records it in {config_path()})",
    )


def read_layout(root: Path) -> dict[str, Any] | None:
    """Return ``{root}/layout.json``, or None if the install has none yet."""
    path = Path(root) / "layout.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LayoutError(
            f"{path} is unreadable: {exc}",
            hint="restore it from a backup, or fix the JSON by hand",
        ) from None
    if not isinstance(data, dict):
        raise LayoutError(f"{path} must hold a JSON object")
    version = data.get("layout_version")
    if not isinstance(version, int):
        raise LayoutError(f"{path} has no integer layout_version")
    if version > LAYOUT_VERSION:
        raise LayoutError(
            f"{path} has layout version {version}, but this rootstock understands "
            f"only up to {LAYOUT_VERSION}",
            hint="upgrade rootstock (pip install -U rootstock) to use this install",
        )
    return data


def write_layout(root: Path, cache_root: Path | None) -> dict[str, Any]:
    """Write a fresh ``layout.json`` declaring ``cache_root`` (None: the root itself)."""
    from rootstock import __version__

    data = {
        "layout_version": LAYOUT_VERSION,
        "cache_root": str(cache_root) if cache_root else None,
        "written_by": f"rootstock {__version__}",
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    atomic_write_json(Path(root) / "layout.json", data)
    return data


def resolve_cache_root(
    root: Path, override: str | os.PathLike | None = None, cluster: str | None = None
) -> Path:
    """Find the cache root of ``root`` in the documented order."""
    if override:
        return Path(override).expanduser().absolute()
    layout = read_layout(root)
    if layout is not None and "cache_root" in layout:
        declared = layout["cache_root"]
        return Path(declared) if declared else Path(root)
    legacy = _legacy_cache_root(root, cluster)
    if legacy:
        return legacy
    return Path(root)


def _legacy_cache_root(root: Path, cluster: str | None) -> Path | None:
    """The registry's legacy ``cache_root`` for ``root``, if any entry has one."""
    if cluster:
        # ``cluster`` may name an unregistered machine of a shared install (root= and
        # cluster= together), so an unknown name is not an error here.
        entry = load_registry().get(cluster.lower())
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
    """Resolve both roots and say which rule supplied each (for ``rootstock resolve``)."""
    if root:
        root_source = "--root"
    elif os.environ.get(ROOT_ENV):
        root_source = f"${ROOT_ENV}"
    elif load_config().get("root"):
        root_source = f"config ({config_path()})"
    else:
        root_source = f"cluster registry ({cluster})" if cluster else "none"
    resolved = resolve_root(root, cluster)
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
        "root_source": root_source,
        "root_exists": resolved.is_dir(),
        "cache_root": str(resolve_cache_root(resolved, cache_root, cluster)),
        "cache_root_source": cache_source,
        "layout_version": layout.get("layout_version") if layout else None,
        "cluster": cluster,
        "siblings": sorted(c.name for c in clusters_for_root(resolved)),
    }
