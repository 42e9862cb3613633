"""The one place rootstock runs ``uv``.

Every call goes through :func:`run_uv`, which scrubs the environment (no
PYTHONPATH, no user site, no active venv), points uv's cache and managed Pythons
into the install root, redirects HOME and the XDG/HF caches into the cache root,
and relays uv's output when it fails. uv's own settings (``UV_INDEX_URL``,
``UV_FIND_LINKS``, ``UV_CONSTRAINT``, a user ``uv.toml``) pass through untouched.
uv runs under the build supervisor (:mod:`rootstock.install.supervise`), so uv and
everything it spawns die with the ``rootstock`` process, and a timeout ends them all.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from rootstock.errors import BuildError
from rootstock.install.layout import InstallLayout
from rootstock.install.supervise import run_supervised

log = logging.getLogger("rootstock.build")

_SCRUBBED = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "PYTHONUSERBASE",
    "UV_PROJECT_ENVIRONMENT",
    "UV_PYTHON",
)


_lookup_lock = threading.Lock()


def uv_binary() -> str:
    """The uv executable: the one shipped by the ``uv`` PyPI package, else PATH.

    Serialised: ``find_uv_bin`` reads ``sysconfig``, whose lazy set-up on Python 3.11
    is not thread-safe (two builds of a ``sync --jobs`` pool starting at once saw
    ``get_config_var("EXE")`` as None).
    """
    with _lookup_lock:
        try:
            from uv import find_uv_bin

            return find_uv_bin()
        except (ImportError, FileNotFoundError):
            found = shutil.which("uv")
            if found:
                return found
    raise BuildError(
        "cannot find the uv executable",
        hint="reinstall rootstock (it depends on the `uv` package), or put uv on PATH",
    )


def uv_environment(layout: InstallLayout) -> dict[str, str]:
    """The environment every uv subprocess runs with."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    real_home = Path.home()
    user_config = Path(os.environ.get("XDG_CONFIG_HOME", real_home / ".config")) / "uv" / "uv.toml"
    if "UV_CONFIG_FILE" not in env and user_config.is_file():
        # HOME is redirected below; keep the maintainer's own uv settings visible.
        env["UV_CONFIG_FILE"] = str(user_config)
    env.update(
        PYTHONNOUSERSITE="1",
        UV_CACHE_DIR=str(layout.uv_cache_dir),
        UV_PYTHON_INSTALL_DIR=str(layout.python_dir),
        HOME=str(layout.home_dir),
        XDG_CACHE_HOME=str(layout.cache_dir),
        HF_HOME=str(layout.cache_dir / "huggingface"),
        UV_NO_PROGRESS="1",
    )
    return env


def run_uv(
    layout: InstallLayout,
    args: Sequence[str | os.PathLike],
    *,
    what: str,
    verbose: bool = False,
    timeout: float | None = None,
    extra_env: dict[str, str] | None = None,
    unset_env: Sequence[str] = (),
    cwd: Path | None = None,
) -> str:
    """Run ``uv ARGS``; return its combined output, or raise :class:`BuildError`.

    With ``verbose`` the output streams to the terminal as it happens (and is not
    returned); otherwise it is captured and shown only if uv fails. ``unset_env``
    names variables of the caller's environment that this one call must not see.
    """
    cmd = [uv_binary(), *map(str, args)]
    env = uv_environment(layout)
    if extra_env:
        env.update(extra_env)
    for key in unset_env:
        env.pop(key, None)
    log.debug("running %s", " ".join(cmd))
    try:
        proc = run_supervised(
            cmd,
            env=env,
            cwd=cwd,
            stdout=None if verbose else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        output = exc.output if isinstance(exc.output, str) else ""
        raise BuildError(f"uv timed out after {timeout:.0f} s while {what}", output) from None
    output = proc.stdout or ""
    if proc.returncode != 0:
        raise BuildError(
            f"uv failed while {what} (exit code {proc.returncode})",
            output,
            hint="re-run with -v to see uv's full output",
        )
    return output


def uv_version(layout: InstallLayout) -> str | None:
    """The version of the uv that builds run (``"0.9.5"``), or None if it cannot say.

    Asked through :func:`run_uv`, so ``uv --version`` runs like every build step:
    the same binary, the scrubbed environment (no active venv, no ``UV_PYTHON``), the
    root's uv cache and HOME, under the supervisor. The version goes into each env's
    metadata; a uv that cannot report it must not fail the build it finished.
    """
    try:
        output = run_uv(layout, ["--version"], what="reporting its version", timeout=30)
    except (BuildError, OSError):
        return None
    # stdout and stderr arrive merged: take the "uv X.Y.Z (...)" line, not a warning.
    for line in output.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "uv":
            return words[1]
    return None
