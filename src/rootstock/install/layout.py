"""Where things live in an install: its paths, and the ``layout.json`` that declares them.

Which root and cache root a command uses is resolved in
:mod:`rootstock.install.machine`; this module only names the paths under them and
reads and writes ``{root}/layout.json``.

A ``layout.json`` always declares the cache root: ``"cache_root": null`` declares
the root itself.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rootstock.errors import UPGRADE_HINT, LayoutError, UsageError
from rootstock.install.atomic import atomic_write_json
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
#: Overrides the root's ``images`` setting (layout.json) for the builds run with it.
IMAGES_ENV = "ROOTSTOCK_IMAGES"
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

    @property
    def reverify_dir(self) -> Path:
        """Where a worker start marks checkpoints whose weight files changed."""
        return self.root / ".reverify"

    def reverify_marker(self, env_name: str, checkpoint: str) -> Path:
        """The marker asking the next verification to re-hash ``checkpoint``'s weights.

        Named by a hash of the env and the id, so any id makes a plain file name and a
        second worker start finds the first one's marker instead of adding another.
        """
        key = hashlib.sha256(f"{env_name}\0{checkpoint}".encode()).hexdigest()[:32]
        return self.reverify_dir / f"{key}.json"

    def env_dir(self, name: str) -> Path:
        return self.envs_dir / name

    def env_source(self, name: str) -> Path:
        return self.envs_dir / name / "env_source.py"

    def generation(self, name: str) -> Path:
        """The build directory ``envs/<name>`` links to now (``envs/.<name>.<id>``).

        One ``readlink``, where a ``realpath`` would look up every component again:
        on a shared filesystem each is a round trip to its metadata server. An env
        that is not a link (a layout before generations) is its own directory.
        """
        link = self.env_dir(name)
        try:
            target = os.readlink(link)
        except OSError:
            return Path(os.path.realpath(link))
        return Path(os.path.normpath(link.parent / target))

    def env_python(self, name: str) -> Path:
        return self.envs_dir / name / "bin" / "python"

    def registered_source(self, name: str) -> Path:
        return self.environments_dir / f"{name}.py"


def read_layout(root: Path) -> dict[str, Any] | None:
    """Return ``{root}/layout.json``, or None if the install has none yet.

    Raises :class:`LayoutError` naming the file (and the field) for a file that is
    not a regular file or is over
    :data:`~rootstock.install.parsing.SMALL_FILE_MAX_BYTES`, for text that is not
    UTF-8 JSON, nests too deep, holds NaN, is not an object, has no
    non-negative integer ``layout_version`` or a newer one than this client knows,
    declares a ``cache_root`` that is neither null nor an absolute path, or an
    ``images`` or ``shared`` that is not a boolean. ``written_by`` and
    ``written_at`` are informational and never read, so their values are not
    checked; nor are keys this version does not know.
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
            hint=UPGRADE_HINT,
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
    if "images" in data and not isinstance(data["images"], bool):
        raise LayoutError(
            f"{path}: images must be true or false, not {type_name(data['images'])}",
            hint='edit "images" in that file, or run `rootstock init --force --images` '
            "(or --no-images)",
        )
    if "shared" in data and not isinstance(data["shared"], bool):
        raise LayoutError(
            f"{path}: shared must be true or false, not {type_name(data['shared'])}",
            hint='edit "shared" in that file, or run `rootstock init --force --shared` '
            "(or --private)",
        )
    return data


def _cache_root_problem(value: object) -> str | None:
    """Why ``value`` cannot be a declared cache root (null or an absolute path), or None."""
    if value is None:
        return None
    # ``~`` would be a different home for every user of a shared install.
    return absolute_path_problem(value)


def write_layout(
    root: Path,
    cache_root: str | os.PathLike | None,
    images: bool | None = None,
    shared: bool | None = None,
) -> dict[str, Any]:
    """Write a fresh ``layout.json`` declaring ``cache_root`` (None: the root itself),
    ``images`` (whether builds pack an image) and ``shared`` (whether others use the
    root: :mod:`rootstock.install.sharing`), each when it is not None.

    Refuses (:class:`LayoutError`, nothing written) a ``cache_root`` that
    :func:`read_layout` would refuse: empty, relative, ``~``-relative, or with NUL.
    """
    from rootstock.version import __version__

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
    if images is not None:
        data["images"] = images
    if shared is not None:
        data["shared"] = shared
    atomic_write_json(Path(root) / "layout.json", data)
    return data


def images_enabled(layout: InstallLayout) -> bool:
    """Whether builds pack an image: ``$ROOTSTOCK_IMAGES`` (0 or 1), else ``images``
    in layout.json, else yes. ``install --image/--no-image`` comes before both."""
    override = os.environ.get(IMAGES_ENV, "").strip().lower()
    if override in ("1", "true", "yes", "on"):
        return True
    if override in ("0", "false", "no", "off"):
        return False
    if override:
        raise UsageError(
            f"${IMAGES_ENV} must be 0 or 1, not {os.environ[IMAGES_ENV]!r}",
            hint="unset it to follow the root's setting (images in layout.json)",
        )
    declared = (read_layout(layout.root) or {}).get("images", True)
    return declared is not False


def set_layout_images(root: Path, images: bool) -> dict[str, Any]:
    """Rewrite ``layout.json`` with ``images`` set, keeping everything else it declares."""
    return update_layout(root, images=images)


def update_layout(root: Path, **fields: bool) -> dict[str, Any]:
    """Rewrite ``layout.json`` with ``fields`` (``images``, ``shared``) set, keeping
    everything else it declares; a root with none gets a fresh one."""
    from rootstock.version import __version__

    data = dict(read_layout(root) or {})
    if not data:
        return write_layout(root, None, fields.get("images"), fields.get("shared"))
    data.update(
        fields,
        written_by=f"rootstock {__version__}",
        written_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    atomic_write_json(Path(root) / "layout.json", data)
    return data
