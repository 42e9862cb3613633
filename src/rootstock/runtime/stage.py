"""Node-local stages of env builds: workers start from this node, not the shared root.

A build with an image (:mod:`rootstock.install.images`) is staged once per node and
user, then every worker of that build on the node starts from the stage:

* ``mount``: the image is copied to node-local disk and ``squashfuse`` mounts it
  (no root needed), shared by the user's workers; a keeper process
  (:mod:`rootstock.runtime.stage_keeper`) unmounts it once no worker has used it
  for the idle timeout;
* ``copy``: the image is copied to node-local disk and extracted there
  (``unsquashfs``), for nodes without FUSE.

Either way the shared filesystem serves one sequential read of one file per node,
checked against the sha256 the build recorded, instead of tens of thousands of
metadata operations per worker. ``auto`` (the default) mounts where ``squashfuse``
and ``/dev/fuse`` work, else copies; ``off`` starts from the shared env as before.

What stays on the shared root: ``env_source.py`` (read at every spawn, so a hotfix
applies), the HOME/XDG/HF redirection and the weights in ``cache/``, and the
generation lock, which the worker takes on the shared generation
(``$ROOTSTOCK_GENERATION``).

The stage directory and its entries, locks and cleaning are
:mod:`rootstock.runtime.stage_dir`. Staging runs under the node's per-user lock, so
two workers starting at once stage once; under it, leftovers of a staging that was
killed are removed, and so are the entries of the env's older builds nobody uses.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rootstock.errors import UsageError
from rootstock.install.config import STAGE_MODES
from rootstock.install.parsing import ParseProblem, loads_json
from rootstock.runtime.stage_dir import (
    IMAGE_FILE,
    MOUNT_DIR,
    PART_MARK,
    TREE_DIR,
    StageRefused,
    detach,
    hold_shared,
    is_live_mount,
    node_lock,
    private_stage_root,
    stage_root,
    sweep,
    write_source,
)

if TYPE_CHECKING:
    from rootstock.install.layout import InstallLayout

__all__ = [
    "GENERATION_ENV",
    "Stage",
    "StageRefused",
    "stage_for_worker",
    "stage_image",
    "stage_mode",
]

log = logging.getLogger("rootstock.runtime")

STAGE_ENV = "ROOTSTOCK_STAGE"
STAGE_IDLE_ENV = "ROOTSTOCK_STAGE_IDLE_S"
#: The shared generation a staged worker holds (the worker's own name for it is
#: ``rootstock.wire.generation.GENERATION_ENV``: the worker imports nothing of ours).
GENERATION_ENV = "ROOTSTOCK_GENERATION"
#: A mount nobody has used for this long is unmounted by its keeper.
DEFAULT_IDLE_S = 600.0
#: How long a new mount may take to appear.
MOUNT_TIMEOUT_S = 120.0
_CHUNK = 4 << 20

_warned: set[str] = set()


class ImageMismatch(StageRefused):
    """The image does not hash to what its build recorded: no mode may use it."""


@dataclass
class Stage:
    """A staged build a worker starts from, held in use until :meth:`release`."""

    mode: str  # "mount" or "copy"
    prefix: Path  # the venv: the mount point or the extracted tree
    generation: Path  # the shared generation it was staged from
    entry: Path
    _hold: int | None = None

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    def release(self) -> None:
        """Stop holding the entry in use (the worker it served has ended)."""
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None


def stage_mode(explicit: str | None = None) -> str:
    """The stage mode: the ``stage=`` keyword, else ``$ROOTSTOCK_STAGE``, else
    ``stage`` in config.toml, else ``auto``. Refuses an unknown mode."""
    if explicit is not None:
        return check_mode(explicit, "stage=")
    value = os.environ.get(STAGE_ENV, "").strip()
    if value:
        return check_mode(value, f"${STAGE_ENV}")
    from rootstock.install.config import load_config

    configured = load_config().get("stage")  # checked there: a ConfigError names the file
    return "auto" if configured is None else str(configured).strip().lower()


def check_mode(value: object, where: str) -> str:
    if isinstance(value, str) and value.strip().lower() in STAGE_MODES:
        return value.strip().lower()
    raise UsageError(
        f"{where} must be one of {', '.join(STAGE_MODES)}, not {value!r}",
        hint="auto stages where it can; off starts workers from the shared env",
    )


def idle_timeout() -> float:
    """How long an unused mount stays (``$ROOTSTOCK_STAGE_IDLE_S``, default 600 s)."""
    raw = os.environ.get(STAGE_IDLE_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_IDLE_S
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(
            f"${STAGE_IDLE_ENV} must be a number of seconds, not {raw!r}",
            hint=f"unset it for the default ({DEFAULT_IDLE_S:.0f} s)",
        )
    return value


def can_mount() -> bool:
    """Whether ``squashfuse`` can mount here: the tool, ``/dev/fuse`` and, for a user
    other than root, ``fusermount3``."""
    if shutil.which("squashfuse") is None:
        return False
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return False
    return os.getuid() == 0 or shutil.which("fusermount3") is not None


def can_extract() -> bool:
    return shutil.which("unsquashfs") is not None


@dataclass(frozen=True)
class BuildImage:
    """The image of a build: where it lies and what it must hash to."""

    env: str
    generation: Path
    path: Path
    sha256: str
    size: int

    @property
    def entry_name(self) -> str:
        return self.generation.name.lstrip(".")  # <env>.<build-id>

    @property
    def env_dir(self) -> str:
        """The env's link on the shared root (``envs/<name>``), as its stages record it."""
        return str(self.generation.parent / self.env)


def build_image(layout: InstallLayout, env: str) -> BuildImage | None:
    """The image recorded for the build env ``env`` runs now, or None."""
    from rootstock.install.envs import ENV_METADATA

    generation = layout.generation(env)
    try:
        record = loads_json((generation / ENV_METADATA).read_bytes())
    except (OSError, ParseProblem):
        return None
    image = record.get("image") if isinstance(record, dict) else None
    if not isinstance(image, dict):
        return None
    name, digest, size = image.get("file"), image.get("sha256"), image.get("size")
    if not (isinstance(name, str) and name and "/" not in name and name not in (".", "..")):
        return None
    if not isinstance(digest, str) or not isinstance(size, int) or isinstance(size, bool):
        return None
    return BuildImage(env, generation, generation / name, digest, size)


def stage_for_worker(layout: InstallLayout, env: str, mode: str) -> Stage | None:
    """Stage the build env ``env`` of ``layout`` runs for a worker, or None to start it
    from the shared env (``off``, no image, or a stage refused: said in one warning
    line). Where the root makes no images, a build without one under ``auto`` is no
    news, and nothing is said.
    """
    if mode == "off":
        return None
    image = build_image(layout, env)
    if image is None:
        from rootstock.install.layout import images_enabled

        if mode != "auto" or images_enabled(layout):
            _warn_once(
                f"noimage:{layout.root}:{env}",
                f"{env}: this build has no image, so its worker starts from the shared env "
                f"(rebuild it with `rootstock install {env} --force --image` to stage it)",
            )
        return None
    try:
        return stage_image(image, mode)
    except StageRefused as exc:
        _warn_once(f"refused:{image.generation}:{exc}", f"{exc}; starting from the shared env")
        return None


def stage_image(image: BuildImage, mode: str) -> Stage:
    """Stage ``image`` by ``mode`` (``auto``: mount where FUSE works, else copy);
    :class:`StageRefused` says why it cannot be."""
    if mode == "auto":
        if (stage_root() / image.entry_name / TREE_DIR).is_dir():
            return _stage(image, "copy")  # extracted on this node already: no second read
        if can_mount():
            try:
                return _stage(image, "mount")
            except ImageMismatch:
                raise
            except StageRefused:
                if not can_extract():
                    raise
        return _stage(image, "copy")
    return _stage(image, mode)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def _stage(image: BuildImage, mode: str) -> Stage:
    if mode == "mount" and not can_mount():
        raise StageRefused("cannot mount the image here (no squashfuse, or no /dev/fuse)")
    if mode == "copy" and not can_extract():
        raise StageRefused("cannot extract the image here (unsquashfs is not installed)")
    root = private_stage_root()
    with node_lock(root):
        sweep(root, replaced=(image.env_dir, image.entry_name))
        entry = root / image.entry_name
        entry.mkdir(mode=0o700, exist_ok=True)
        write_source(
            entry,
            {
                "env": image.env,
                "env_dir": image.env_dir,
                "generation": str(image.generation),
                "sha256": image.sha256,
            },
        )
        hold = hold_shared(entry)
        try:
            prefix = _prepare(image, entry, mode)
        except BaseException:
            os.close(hold)
            raise
    return Stage(mode, prefix, image.generation, entry, hold)


def _prepare(image: BuildImage, entry: Path, mode: str) -> Path:
    local = entry / IMAGE_FILE
    if mode == "copy" and (entry / TREE_DIR).is_dir():
        return entry / TREE_DIR
    if not local.is_file():
        copy_verified(image, local)
    if mode == "copy":
        _extract(local, entry / TREE_DIR)
        local.unlink(missing_ok=True)  # the tree is what runs; the copy costs disk
        return entry / TREE_DIR
    mount = entry / MOUNT_DIR
    if not is_live_mount(mount):
        _mount(local, mount, entry)
    return mount


def copy_verified(image: BuildImage, target: Path) -> None:
    """Copy ``image`` to ``target`` in one sequential read, hashing it on the way;
    renamed into place only when complete and matching (:class:`StageRefused` else)."""
    part = target.with_name(f"{target.name}{PART_MARK}{os.getpid()}")
    digest = hashlib.sha256()
    size = 0
    log.info(
        "staging %s: copying its %.0f MB image from %s", image.env, image.size / 1e6, image.path
    )
    try:
        with image.path.open("rb") as src, open(part, "xb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                dst.write(chunk)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise StageRefused(f"cannot copy the image {image.path}: {exc}") from None
    if size != image.size or digest.hexdigest() != image.sha256:
        part.unlink(missing_ok=True)
        raise ImageMismatch(
            f"the image {image.path} does not match the sha256 its build recorded "
            f"(read {size} bytes, sha256 {digest.hexdigest()[:12]}…; recorded {image.size} "
            f"bytes, {image.sha256[:12]}…): it is refused. A maintainer should rebuild "
            f"the env (`rootstock install {image.env} --force`)"
        )
    os.replace(part, target)


def _extract(local: Path, tree: Path) -> None:
    part = tree.with_name(f"{tree.name}{PART_MARK}{os.getpid()}")
    proc = subprocess.run(
        ["unsquashfs", "-no-xattrs", "-quiet", "-no-progress", "-d", str(part), str(local)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        shutil.rmtree(part, ignore_errors=True)
        raise StageRefused(f"unsquashfs could not extract {local}: {proc.stderr.strip()}")
    os.chmod(part, 0o700)
    os.replace(part, tree)


def _mount(local: Path, mount: Path, entry: Path) -> None:
    if not sys.executable:
        raise StageRefused("this Python cannot start the mount's keeper (no sys.executable)")
    detach(mount)  # a mount whose server died answers nothing: let it go first
    mount.mkdir(mode=0o700, exist_ok=True)
    log_fd = _open_keeper_log(entry)
    try:
        keeper = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rootstock.runtime.stage_keeper",
                str(entry),
                str(idle_timeout()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_fd,
            close_fds=True,
            cwd="/",  # it outlives us: it must not hold our working directory
            start_new_session=True,  # it serves this node's workers after we are gone
        )
    finally:
        os.close(log_fd)
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    delay = 0.01
    while not is_live_mount(mount):
        if keeper.poll() is not None:
            raise StageRefused(f"squashfuse could not mount {local} (see {entry / 'keeper.log'})")
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(keeper.pid, signal.SIGTERM)
            raise StageRefused(
                f"the mount of {local} did not appear within {MOUNT_TIMEOUT_S:.0f} s"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _open_keeper_log(entry: Path) -> int:
    return os.open(entry / "keeper.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
