"""The environment a worker runs with, built from the caller's.

What the caller's Python could leak into the worker is scrubbed (``SCRUBBED_VARS``);
HOME and the caches point into the install, the hub is offline except for a
download, the Hugging Face token is handed over when one is found, and the compiler
and kernel caches go to a per-user directory outside the shared root, with a
private one of last resort when the user's home cannot hold it. ``spawn.py`` starts
every process that runs a model with this environment.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pwd
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rootstock.install.parsing import NotRegularFile, open_regular_file
from rootstock.runtime.server import can_create_files, is_private_dir, make_private_dir

if TYPE_CHECKING:
    from rootstock.install.layout import InstallLayout

log = logging.getLogger("rootstock.runtime")

# Variables that would make the worker load code or settings from the caller's
# Python. PYTHONPYCACHEPREFIX is here because a caller's prefix would make the
# worker ignore the env's pre-compiled bytecode and recompile on every spawn.
SCRUBBED_VARS = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "PYTHONPYCACHEPREFIX",
    "PYTHONEXECUTABLE",
    "PYTHONINSPECT",
    "__PYVENV_LAUNCHER__",
)

# Compiler and kernel caches: per user, outside the shared root (users cannot
# write there, and sharing JIT output between users is unsafe). A value the user
# already set is kept.
COMPILER_CACHE_VARS = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "CUDA_CACHE_PATH": "nv-compute-cache",
    "PYTORCH_KERNEL_CACHE_PATH": "torch-kernels",
    "TORCH_EXTENSIONS_DIR": "torch-extensions",
    "NUMBA_CACHE_DIR": "numba",
    "CUPY_CACHE_DIR": "cupy",
    "JAX_COMPILATION_CACHE_DIR": "jax",
    "SYCL_CACHE_DIR": "sycl",
    "MPLCONFIGDIR": "matplotlib",
}

HF_TOKEN_FILES = ("~/.hf_token", "~/.cache/huggingface/token")
# A token is a few dozen characters.
_MAX_TOKEN_BYTES = 1 << 16
#: The prefix of the compiler-cache directory of last resort (see compiler_cache_dir).
LAST_RESORT_CACHE_PREFIX = "rootstock-cc-"


def real_home(environ: Mapping[str, str] | None = None) -> Path:
    """The calling user's own home (before any redirection)."""
    home = (os.environ if environ is None else environ).get("HOME")
    if home:
        return Path(home)
    return Path(pwd.getpwuid(os.getuid()).pw_dir)


def find_hf_token(environ: dict[str, str], home: Path) -> tuple[str | None, str | None]:
    """The Hugging Face token and where it came from, or (None, None).

    ``HF_TOKEN`` wins; otherwise the first readable, non-empty file of
    ``$HF_TOKEN_FILE``, ``~/.hf_token`` and ``~/.cache/huggingface/token`` (in the
    user's real home), with surrounding whitespace stripped.
    """
    token = environ.get("HF_TOKEN", "").strip()
    if token:
        return token, "HF_TOKEN"
    candidates = []
    if environ.get("HF_TOKEN_FILE"):
        candidates.append(Path(environ["HF_TOKEN_FILE"]).expanduser())
    candidates += [home / name.removeprefix("~/") for name in HF_TOKEN_FILES]
    for path in candidates:
        try:
            with os.fdopen(open_regular_file(path, follow_symlinks=True), "rb") as fh:
                token = fh.read(_MAX_TOKEN_BYTES).decode("utf-8").strip()
        except NotRegularFile as exc:
            log.warning("skipped the token file %s: %s (remove it: %s)", path, exc, exc.fix)
            continue
        except (OSError, UnicodeDecodeError):
            continue
        if token:
            return token, str(path)
    return None, None


def _inside(path: Path, roots: list[Path]) -> bool:
    real = os.path.realpath(path)
    for root in roots:
        top = os.path.realpath(root)
        if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
            return True
    return False


def _usable_cache_dir(path: Path, *, parents: bool) -> bool:
    """Make ``path`` (0700) if it is missing; True if it is ours, private and writable."""
    with contextlib.suppress(OSError):
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    return is_private_dir(path) and can_create_files(path)


# The fresh directory of the last resort, made once per process (not once per spawn).
_last_resort_cache: Path | None = None


def compiler_cache_dir(environ: dict[str, str], layout: InstallLayout) -> Path:
    """The per-user directory for compiler caches, never inside the install or cache root.

    ``$XDG_CACHE_HOME/rootstock`` (or ``~/.cache/rootstock``) of the real user; else
    ``rootstock-<uid>`` in the temp dir (``$TMPDIR``, ``/tmp``), the one fallback per
    user; else (someone else holds that name, or it is not 0700) a fresh private
    directory, one per process. Each is used only if it is a real directory we own
    with mode 0700, and a file can really be created in it.

    The fresh one (``rootstock-cc-<pid>-XXXXXXXX``) lives only as long as its
    process: it is removed at exit, and it records its owner like a run directory,
    so the next rootstock process sweeps it if this one is killed first.
    """
    global _last_resort_cache
    shared = [layout.root, layout.cache_root]
    xdg = environ.get("XDG_CACHE_HOME") or str(real_home(environ) / ".cache")
    preferred = Path(xdg) / "rootstock"
    if not _inside(preferred, shared) and _usable_cache_dir(preferred, parents=True):
        return preferred
    fallback = Path(tempfile.gettempdir()) / f"rootstock-{os.getuid()}"
    if _usable_cache_dir(fallback, parents=False):
        return fallback
    if _last_resort_cache is None or not is_private_dir(_last_resort_cache):
        _last_resort_cache = make_private_dir(LAST_RESORT_CACHE_PREFIX, base=fallback.parent)
        atexit.register(_remove_last_resort_cache, _last_resort_cache, os.getpid())
        log.warning(
            "%s is not a private directory of yours; compiler caches go to %s for now",
            fallback,
            _last_resort_cache,
        )
    return _last_resort_cache


def _remove_last_resort_cache(path: Path, maker: int) -> None:
    # A forked child inherits the exit hook, not the directory: the maker removes it.
    if os.getpid() == maker:
        shutil.rmtree(path, ignore_errors=True)


def worker_environment(
    layout: InstallLayout,
    env_name: str,
    *,
    offline: bool = True,
    base: dict[str, str] | None = None,
    prefix: Path | None = None,
) -> dict[str, str]:
    """The complete environment a worker of ``env_name`` runs with; ``prefix`` is the
    venv it runs from when that is not the shared env (a node-local stage)."""
    env = dict(os.environ if base is None else base)
    home = real_home(env)
    compile_cache = compiler_cache_dir(env, layout)
    token, _source = find_hf_token(env, home)
    for var in SCRUBBED_VARS:
        env.pop(var, None)
    env_dir = layout.env_dir(env_name) if prefix is None else prefix
    env["VIRTUAL_ENV"] = str(env_dir)
    env["PATH"] = os.pathsep.join(p for p in (str(env_dir / "bin"), env.get("PATH")) if p)
    env["PYTHONNOUSERSITE"] = "1"
    env["HOME"] = str(layout.home_dir)
    env["XDG_CACHE_HOME"] = str(layout.cache_dir)
    env["HF_HOME"] = str(layout.cache_dir / "huggingface")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        # The download phase exists to reach the hub: an offline flag inherited from
        # the maintainer's shell would make it fail for no visible reason.
        env.pop("HF_HUB_OFFLINE", None)
    if token:
        env["HF_TOKEN"] = token
        env["HUGGING_FACE_HUB_TOKEN"] = token
    for var, sub in COMPILER_CACHE_VARS.items():
        if not env.get(var):
            env[var] = str(compile_cache / sub)
    return env
