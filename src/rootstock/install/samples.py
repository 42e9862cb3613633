"""The sample env files that ship with rootstock (``environments/*.py`` in a checkout).

A wheel carries them as ``rootstock/sample_envs/`` (pyproject's hatch force-include);
a checkout, installed editable, has them in its own ``environments/``. They are read
with the ast-based env-file parser, never imported: naming the file that declares a
checkpoint id costs no ML library.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from rootstock.errors import EnvFileError
from rootstock.install.envfile import EnvFile, parse_env_file

PACKAGED_DIR = "sample_envs"


def sample_envs_dir() -> Path | None:
    """Where the sample env files lie: the installed package's copy, else the
    checkout's ``environments/`` beside ``src/``; None if neither is there."""
    packaged = resources.files("rootstock").joinpath(PACKAGED_DIR)
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    checkout = Path(str(resources.files("rootstock"))).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "environments").is_dir():
        return checkout / "environments"
    return None


def sample_env_files() -> list[Path]:
    """Every sample env file, sorted by name (none if the files are not found)."""
    directory = sample_envs_dir()
    if directory is None:
        return []
    return sorted(p for p in directory.glob("*.py") if p.is_file())


def sample_declaring(checkpoint: str) -> EnvFile | None:
    """The sample env file whose ``CHECKPOINTS`` declares ``checkpoint``, or None."""
    for path in sample_env_files():
        try:
            env, _problems = parse_env_file(path)
        except EnvFileError:
            continue
        if checkpoint in env.checkpoints:
            return env
    return None


def path_to_pass(path: Path) -> str:
    """``path`` as a user would type it here: relative to the working directory when
    it lies below it (``environments/mace.py`` in a checkout), absolute otherwise."""
    try:
        here = Path.cwd()
    except OSError:
        return str(path)
    resolved = path.resolve()
    if resolved.is_relative_to(here.resolve()):
        return os.path.relpath(resolved, here.resolve())
    return str(path)
