"""``rootstock init``: create an install root, declare its cache root, save config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootstock.errors import RootstockError
from rootstock.install.config import config_path, load_config, save_config
from rootstock.install.layout import (
    InstallLayout,
    read_layout,
    set_layout_images,
    update_layout,
    write_layout,
)
from rootstock.install.machine import resolve_cache_root, suggest_cluster
from rootstock.install.perms import maintainer_umask
from rootstock.install.sharing import SHARED_KEY, root_is_shared, sharing_default

# What marks a root as already in use: init must not overwrite any of it.
_STATE_NAMES = ("layout.json", "manifest.json", "envs", "environments")


@dataclass
class InitRequest:
    """Everything init needs, whether it came from flags or prompts."""

    root: Path
    cache_root: Path | None = None
    cluster: str | None = None
    maintainer_name: str | None = None
    maintainer_email: str | None = None
    api_url: str | None = None
    api_key: str | None = None
    api_secret: str | None = None
    force: bool = False
    #: Whether builds pack an image (layout.json ``images``); None leaves it as it is.
    images: bool | None = None
    #: Whether others use the root (layout.json ``shared``); None: the default for
    #: a new root (:func:`~rootstock.install.sharing.sharing_default`), else as it is.
    shared: bool | None = None


@dataclass
class InitResult:
    """What init created, and what it deliberately left alone."""

    root: Path
    cache_root: Path
    cluster: str
    config_file: Path
    images: bool = True
    shared: bool = False
    created: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The ``init --json`` document."""
        return {
            "root": str(self.root),
            "cache_root": str(self.cache_root),
            "cluster": self.cluster,
            "config_file": str(self.config_file),
            "images": self.images,
            "shared": self.shared,
            "created": self.created,
            "kept": self.kept,
            "notes": self.notes,
        }


def is_populated(root: Path) -> bool:
    """True when ``root`` already holds install state."""
    return any((root / name).exists() for name in _STATE_NAMES)


def init_root(request: InitRequest) -> InitResult:
    """Create or complete an install root.

    On a populated root this refuses unless ``force``; with ``force`` it only adds
    what is missing and never touches the manifest, the envs or the declared
    cache root.
    """
    from rootstock.install.manifest import ensure_manifest

    root = request.root.expanduser().absolute()
    if is_populated(root) and not request.force:
        raise RootstockError(
            f"{root} is already an install root",
            hint="use it as it is; `rootstock init --force` only adds what is missing "
            "(it never rewrites the manifest, the envs or the cache root)",
        )
    cluster = (request.cluster or suggest_cluster(root)).lower()
    result = InitResult(root, root, cluster, config_path())
    with maintainer_umask():
        layout_data = read_layout(root) if root.exists() else None
        requested = request.cache_root.expanduser().absolute() if request.cache_root else None
        if layout_data is None:
            # Judged before mkdir: a root made here under umask 002 is group-writable.
            shared = _new_root_shared(root, request.shared, result.notes)
            root.mkdir(parents=True, exist_ok=True)
            # Declare what the install uses: the requested cache root, else (for a
            # legacy or registered root) the registry's entry, else the root itself.
            cache = resolve_cache_root(root, requested, request.cluster)
            write_layout(root, None if cache == root else cache, request.images, shared)
            result.created.append("layout.json")
        else:
            result.kept.append("layout.json")
            if request.images is not None and layout_data.get("images", True) != request.images:
                set_layout_images(root, request.images)
                result.notes.append(
                    f"images are now {'on' if request.images else 'off'} for new builds "
                    "(layout.json); existing builds keep what they have until rebuilt"
                )
            if request.shared is not None and layout_data.get(SHARED_KEY) != request.shared:
                update_layout(root, shared=request.shared)
                result.notes.append(
                    f"the root is now recorded as {'shared' if request.shared else 'private'} "
                    "(layout.json)"
                )
            declared = resolve_cache_root(root)
            if requested and requested != declared:
                result.notes.append(
                    f"the cache root stays {declared} (declared in layout.json); "
                    "to move it, edit layout.json and move cache/ and home/ (see docs)"
                )
        layout = InstallLayout(root, resolve_cache_root(root))
        result.cache_root = layout.cache_root
        result.images = (read_layout(root) or {}).get("images", True) is not False
        result.shared = root_is_shared(layout)
        for directory in (
            layout.environments_dir,
            layout.envs_dir,
            layout.wheels_dir,
            layout.locks_dir,
            layout.home_dir,
            layout.cache_dir,
        ):
            if not directory.exists():
                directory.mkdir(parents=True)
                result.created.append(
                    str(directory.relative_to(root))
                    if directory.is_relative_to(root)
                    else str(directory)
                )
        if layout.manifest_file.exists():
            result.kept.append("manifest.json")
        else:
            ensure_manifest(layout, [cluster])
            result.created.append("manifest.json")
    _save_user_config(request, root, cluster)
    return result


def _new_root_shared(root: Path, asked: bool | None, notes: list[str]) -> bool:
    """``asked``, else the default for ``root``; where there is none, shared, with a note."""
    if asked is not None:
        return asked
    default = sharing_default(root)
    if default.shared is not None:
        return default.shared
    notes.append(
        f"recorded {root} as shared ({default.reason}): permission problems draw a "
        "warning; `rootstock init --force --private` if only you use it"
    )
    return True


def _save_user_config(request: InitRequest, root: Path, cluster: str) -> None:
    config = load_config()
    config.update(root=str(root), cluster=cluster)
    maintainer = {
        "maintainer_name": request.maintainer_name,
        "maintainer_email": request.maintainer_email,
        "api_url": request.api_url,
        "api_key": request.api_key,
        "api_secret": request.api_secret,
    }
    for key, value in maintainer.items():
        if value:
            config[key] = value
    if request.maintainer_name or request.maintainer_email or request.api_key:
        config["is_maintainer"] = True
    config.setdefault("is_maintainer", False)
    save_config(config)
