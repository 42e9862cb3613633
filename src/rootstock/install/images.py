"""Packed images of env builds: one read-only squashfs per generation.

A worker started straight from the shared env makes tens of thousands of metadata
operations on the shared filesystem (docs/cold-start.md). The image packs the
build into one file, which a node reads once, sequentially, and stages locally
(:mod:`rootstock.runtime.stage`).

The image is ``.rootstock-image.sqfs`` inside the generation directory
(``envs/.<name>.<build-id>/``), made by ``mksquashfs`` while the build is still in
staging and renamed with it, so it is deleted only with its generation and a killed
install leaves none that looks finished. It holds the venv as a relocatable tree,
and, when the venv's interpreter lives under the root (``.python/``), that
interpreter too, at the image's top: then the image's ``bin/python`` is a relative
link to that copy and its ``pyvenv.cfg`` has no ``home``, so Python finds its
standard library inside the image. What is read from the shared root at every spawn stays out of it:
``env_source.py`` (the hotfix procedure edits it in place), the build record and
the generation lock.

An image is an optimisation: when ``mksquashfs`` is missing or fails, the build
goes on without one and says so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rootstock.errors import BuildError
from rootstock.install.envs import ENV_METADATA
from rootstock.install.layout import InstallLayout
from rootstock.install.supervise import run_supervised
from rootstock.wire.generation import GENERATION_LOCK

#: The image's name inside its generation directory.
IMAGE_NAME = ".rootstock-image.sqfs"
#: zstd at level 3: measured on the EMT and CHGNet envs (docs/models.md), it packs
#: within 15% of zstd's default level in a twelfth of the time, and reads back faster
#: than lz4's larger image at a shared filesystem's bandwidth.
COMPRESSION = "zstd-3"
_COMPRESSOR_ARGS = ("-comp", "zstd", "-Xcompression-level", "3")
#: Left out of the image: read from the shared generation at every spawn.
LEFT_OUT = ("env_source.py", "env_source.py.lock", ENV_METADATA, GENERATION_LOCK)
MKSQUASHFS_TIMEOUT_S = 3600.0
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImageInfo:
    """An image as the build record and the manifest describe it."""

    file: str
    sha256: str
    size: int
    compression: str
    seconds: float = 0.0

    def to_record(self) -> dict[str, str | int]:
        """The ``image`` object of ``rootstock-env.json`` and the manifest."""
        return {
            "file": self.file,
            "sha256": self.sha256,
            "size": self.size,
            "compression": self.compression,
        }


def mksquashfs() -> str | None:
    """The ``mksquashfs`` on PATH (Debian's ``squashfs-tools``), or None."""
    return shutil.which("mksquashfs")


def interpreter_home(layout: InstallLayout, venv: Path) -> Path | None:
    """The directory of the root's managed interpreter ``venv`` runs on (its top, such as
    ``.python/cpython-3.11.7-linux-x86_64-gnu``), or None when it lives elsewhere."""
    link = venv / "bin" / "python"
    try:
        real = Path(os.path.realpath(link))
        base = Path(os.path.realpath(layout.python_dir))
    except OSError:
        return None
    if not real.is_relative_to(base) or real == base:
        return None
    return base / real.relative_to(base).parts[0]


def make_image(layout: InstallLayout, venv: Path, work: Path) -> ImageInfo:
    """Pack ``venv`` (a staging build) into ``work/IMAGE_NAME``; raise :class:`BuildError`.

    The caller moves the file into the generation before it is renamed into place.
    """
    tool = mksquashfs()
    if tool is None:
        raise BuildError("mksquashfs is not installed", hint="install squashfs-tools")
    image = work / IMAGE_NAME
    sources = [str(entry) for entry in sorted(venv.iterdir()) if entry.name not in LEFT_OUT]
    pseudo: list[str] = []
    excluded: list[str] = []
    home = interpreter_home(layout, venv)
    if home is not None:
        python = venv / "bin" / "python"
        inside = Path(os.path.realpath(python)).relative_to(home)
        cfg = work / "pyvenv.cfg"
        cfg.write_text(
            "".join(
                line
                for line in (venv / "pyvenv.cfg").read_text().splitlines(keepends=True)
                if line.split("=", 1)[0].strip().lower() != "home"
            )
        )
        excluded += [str(python), str(venv / "pyvenv.cfg")]
        uid, gid = os.getuid(), os.getgid()
        pseudo += [
            f"bin/python s 777 {uid} {gid} ../{home.name}/{inside}",
            f"pyvenv.cfg f 644 {uid} {gid} cat {cfg}",
        ]
        # The interpreter joins as one more top-level source: ``<image>/<its name>/``.
        sources.append(str(home))
    pseudo_file = work / "image.pseudo"
    pseudo_file.write_text("".join(line + "\n" for line in pseudo))
    argv = [
        tool,
        *sources,
        str(image),
        "-noappend",
        "-no-xattrs",
        "-no-progress",
        "-quiet",
        "-root-mode",
        "755",
        *_COMPRESSOR_ARGS,
        "-pf",
        str(pseudo_file),
    ]
    if excluded:
        argv += ["-e", *excluded]
    started = time.monotonic()
    proc = run_supervised(argv, env=dict(os.environ), timeout=MKSQUASHFS_TIMEOUT_S)
    if proc.returncode != 0:
        raise BuildError(
            f"mksquashfs failed (exit code {proc.returncode})",
            (proc.stderr or proc.stdout or "").strip(),
            hint="pass --no-image to build without an image",
        )
    seconds = time.monotonic() - started
    image.chmod(0o644)
    return ImageInfo(IMAGE_NAME, file_sha256(image), image.stat().st_size, COMPRESSION, seconds)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in one sequential pass."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
