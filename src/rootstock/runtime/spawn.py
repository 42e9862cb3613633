"""The one place a worker process is started.

:func:`spawn_worker` runs ``python -m rootstock.worker`` with the env's own
interpreter and an environment built by :func:`worker_environment`:

* ``PYTHONPATH`` and friends are scrubbed and the user site is off, so nothing from
  the caller's Python leaks into the model env;
* ``HOME``, ``XDG_CACHE_HOME`` and ``HF_HOME`` point into the cache root, where
  maintainers pre-fetched the weights;
* per-user compiler caches (Triton, TorchInductor, CUDA, ...) point to a private
  directory *outside* the shared root, which ordinary users cannot write;
* the Hugging Face token is found as the seed document describes and exported;
* ``HF_HUB_OFFLINE=1`` unless the caller asks for a download phase.

The worker's output goes to a file, never to a pipe, so a chatty model cannot
fill a 64 KB pipe buffer and deadlock; its tail is kept for error messages.

Every spawned worker holds the read end of a
:class:`~rootstock.runtime.lifeline.Lifeline` (its fd in ``$ROOTSTOCK_LIFELINE_FD``):
when the spawning process is gone, however it died, the worker exits within
moments, even in the middle of a calculation.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rootstock.errors import EnvNotFound
from rootstock.install.parsing import NotRegularFile, ParseProblem, loads_json, open_regular_file
from rootstock.runtime.lifeline import LIFELINE_ENV, Lifeline
from rootstock.runtime.protocol import DOWNLOAD_RESULT_ENV
from rootstock.runtime.server import can_create_files, is_private_dir, make_private_dir

if TYPE_CHECKING:
    from rootstock.install.layout import InstallLayout
    from rootstock.runtime.spec import WorkerSpec

log = logging.getLogger("rootstock.runtime")

WORKER_MODULE = "rootstock.worker"
WORKER_LOG_ENV = "ROOTSTOCK_WORKER_LOG"
LOG_FILE_NAME = "worker.log"
#: In a download's run dir: the paths its ``download()`` hook returned (JSON).
DOWNLOAD_RESULT_FILE = "download-result.json"

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
# A token is a few dozen characters; the download result a list of paths.
_MAX_TOKEN_BYTES = 1 << 16
_MAX_DOWNLOAD_RESULT_BYTES = 1 << 20
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
) -> dict[str, str]:
    """The complete environment a worker of ``env_name`` runs with."""
    env = dict(os.environ if base is None else base)
    home = real_home(env)
    compile_cache = compiler_cache_dir(env, layout)
    token, _source = find_hf_token(env, home)
    for var in SCRUBBED_VARS:
        env.pop(var, None)
    env_dir = layout.env_dir(env_name)
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


class WorkerProcess:
    """A started worker: its process group, its lifeline, where its output went."""

    def __init__(
        self,
        popen: subprocess.Popen,
        output: str,
        log_path: Path | None,
        log_offset: int = 0,
        owned_dir: Path | None = None,
        lifeline: Lifeline | None = None,
    ) -> None:
        self.popen = popen
        self.output = output
        self.log_path = log_path
        self.log_offset = log_offset
        self._owned_dir = owned_dir
        # Held (never written) for as long as the worker may live: our exit closes it.
        self.lifeline = lifeline

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def has_exited(self) -> bool:
        """True once the worker exited; does not reap it, so its group stays addressable."""
        if self.popen.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self.popen.poll() is not None
        return info is not None

    def wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the worker to exit (without reaping it)."""
        deadline = time.monotonic() + timeout
        delay = 0.001
        while not self.has_exited():
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True

    def stop(self, grace: float = 3.0) -> int | None:
        """Let the worker exit within ``grace`` s, then kill its whole process group.

        The group is signalled before the leader is reaped, so its id cannot have
        been reused by then. Returns the exit code (negative: killed by a signal).
        """
        if self.popen.returncode is None:
            exited = grace > 0 and self.wait_exit(grace)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # Also reaps grandchildren the model may have started (compile workers).
                os.killpg(self.pid, signal.SIGKILL)
            # Cut only after the grace (a worker finishing an EXIT keeps its status 0)
            # and after the kill: a cut lifeline ends the worker with STARTER_GONE_EXIT,
            # which would win the race against a killer descheduled in between, and a
            # worker we killed would read as one that exited by itself.
            self._cut_lifeline()
            if not exited:
                log.debug("worker %d did not exit within %.1f s; killed", self.pid, grace)
            self.popen.wait()
        self._cut_lifeline()
        return self.popen.returncode

    def _cut_lifeline(self) -> None:
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None

    def output_tail(self, max_bytes: int = 8192, max_lines: int = 60) -> str:
        """The last lines the worker wrote in this run, or a note on where they went."""
        if self.log_path is None:
            return f"(worker output went to {self.output})"
        # A log the user named may be a link; one in our run dir never is.
        named = self.output != "capture"
        try:
            with os.fdopen(open_regular_file(self.log_path, follow_symlinks=named), "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                start = max(self.log_offset, size - max_bytes)
                fh.seek(start)
                data = fh.read()
        except NotRegularFile as exc:
            return (
                f"(could not read the worker output at {self.log_path}: {exc}; "
                f"remove it: {exc.fix})"
            )
        except OSError as exc:
            return f"(could not read the worker output at {self.log_path}: {exc})"
        lines = data.decode("utf-8", "replace").splitlines()
        if start > self.log_offset and lines:
            lines = lines[1:]  # the first line was cut in half
        return "\n".join(lines[-max_lines:])

    def cleanup(self) -> None:
        """Cut the lifeline and remove a private output directory this process owns."""
        self._cut_lifeline()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None


def _open_output(
    target: str, run_dir: Path | None
) -> tuple[Any, Any, Path | None, int, Path | None]:
    """stdout, stderr, log path, start offset and an owned dir for an output target."""
    if target == "stderr":
        return 2, 2, None, 0, None
    if target == "stdout":
        return 1, subprocess.STDOUT, None, 0, None
    owned = None
    if target == "capture":
        if run_dir is None:
            run_dir = owned = make_private_dir("rootstock-log-")
        path = run_dir / LOG_FILE_NAME
    else:
        path = Path(target).expanduser()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    offset = os.fstat(fd).st_size
    return fd, subprocess.STDOUT, path, offset, owned


def worker_command(
    spec: WorkerSpec,
    *,
    socket_path: Path | str,
    mode: str,
    structure: Path | None = None,
    connect_timeout: float | None = None,
    debug: bool = False,
) -> list[str]:
    """The argv of a worker for ``spec``, run by its env's interpreter.

    ``-I`` keeps the caller's cwd and PYTHON* settings out.
    """
    argv = [
        str(spec.python),
        "-I",
        "-u",
        "-X",
        "faulthandler",
        "-m",
        WORKER_MODULE,
        "--env-source",
        str(spec.env_source),
        "--checkpoint",
        spec.checkpoint,
        "--socket",
        str(socket_path),
        "--mode",
        mode,
        "--device",
        spec.device,
        "--kwargs",
        json.dumps(spec.setup_kwargs or {}),
    ]
    if spec.weights is not None:
        argv += ["--weights", str(spec.weights)]
    if structure is not None:
        argv += ["--structure", str(structure)]
    if connect_timeout is not None:
        argv += ["--connect-timeout", str(connect_timeout)]
    if debug:
        argv.append("--debug")
    return argv


def spawn_worker(
    spec: WorkerSpec,
    *,
    socket_path: Path | str,
    mode: str = "calculator",
    structure: Path | None = None,
    offline: bool = True,
    output: str | None = None,
    run_dir: Path | None = None,
    connect_timeout: float | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> WorkerProcess:
    """Start ``python -m rootstock.worker`` for ``spec`` in its own process group.

    ``mode`` is ``calculator`` (rootstock dialect, errors come back in-band) or
    ``serve`` (standard i-PI client for an external driver). ``output`` is
    ``capture`` (default: a 0600 file in ``run_dir``), ``stderr``, ``stdout`` or a
    file path; ``$ROOTSTOCK_WORKER_LOG`` overrides it. ``offline=False`` lets the
    model download (the fetch phase of ``add``). ``extra_env`` is added to the
    worker's environment last (the download phase's result file).

    The worker gets a lifeline: it exits on its own once this process is gone, and
    :meth:`WorkerProcess.stop` or :meth:`WorkerProcess.cleanup` cut it.
    """
    layout, env_name = spec.layout, spec.env_name
    python = spec.python
    if not python.exists():
        raise EnvNotFound(
            f"env {env_name!r} has no interpreter at {python}",
            hint=f"rebuild it with `rootstock install {env_name} --force`",
        )
    target = os.environ.get(WORKER_LOG_ENV) or output or "capture"
    lifeline = Lifeline()
    argv = worker_command(
        spec,
        socket_path=socket_path,
        mode=mode,
        structure=structure,
        connect_timeout=connect_timeout,
        debug=logging.getLogger("rootstock.wire").isEnabledFor(logging.DEBUG),
    )
    try:
        env = worker_environment(layout, env_name, offline=offline)
        env[LIFELINE_ENV] = str(lifeline.child_fd)
        env.update(extra_env or {})
        stdout, stderr, log_path, offset, owned = _open_output(target, run_dir)
    except BaseException:
        lifeline.close()
        raise
    try:
        popen = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            close_fds=True,
            pass_fds=(lifeline.child_fd,),
            # Own group: Ctrl-C in the user's script does not hit the worker mid-frame,
            # and stop() can kill everything the model started.
            start_new_session=True,
        )
    except BaseException as exc:
        lifeline.close()
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        if not isinstance(exc, OSError):
            raise
        raise EnvNotFound(
            f"cannot start the worker for env {env_name!r} with {python}: {exc}",
            hint=f"check the env, or rebuild it with `rootstock install {env_name} --force`",
        ) from None
    finally:
        if isinstance(stdout, int) and stdout > 2:
            os.close(stdout)
    lifeline.child_started()
    log.debug("spawned worker pid %d: %s (output: %s)", popen.pid, " ".join(argv), target)
    return WorkerProcess(popen, target, log_path, offset, owned, lifeline)


def run_download(
    layout: InstallLayout,
    env_name: str,
    *,
    checkpoint: str,
    setup_kwargs: dict[str, Any] | None = None,
    timeout: float = 3600.0,
) -> list[str]:
    """Run the fetch phase of ``add``: a worker in ``download`` mode, CPU, network on.

    Returns the absolute paths the env's ``download()`` hook returned (empty when it
    returned none, when ``setup()`` did the fetch, or when the env's worker is from
    an older rootstock, which knows no result file). Raises :class:`WorkerError`
    with the worker's output tail when the env's ``download()`` (or ``setup()``)
    fails, or when it runs past ``timeout``.
    """
    from rootstock.errors import WorkerError
    from rootstock.runtime.spec import WorkerSpec

    spec = WorkerSpec(
        layout=layout,
        checkpoint=checkpoint,
        env_name=env_name,
        device="cpu",
        setup_kwargs=setup_kwargs or {},
    )
    run_dir = make_private_dir("rootstock-fetch-")
    result_file = run_dir / DOWNLOAD_RESULT_FILE
    try:
        process = spawn_worker(
            spec,
            socket_path=run_dir / "unused.sock",
            mode="download",
            offline=False,
            run_dir=run_dir,
            extra_env={DOWNLOAD_RESULT_ENV: str(result_file)},
        )
        finished = process.wait_exit(timeout)
        code = process.stop(grace=0 if not finished else 3.0)
        if not finished:
            raise WorkerError(
                f"downloading {checkpoint} took longer than {timeout:.0f} s",
                process.output_tail(),
                hint="check the network from this node, then re-run `rootstock add`",
            )
        if code != 0:
            raise WorkerError(
                f"downloading {checkpoint} failed (env {env_name!r}, exit code {code})",
                process.output_tail(),
                hint="the traceback above comes from the env's download()/setup(); "
                "the maintainer can fix env_source.py, then re-run `rootstock add`",
            )
        return _read_download_result(result_file)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _read_download_result(path: Path) -> list[str]:
    """The paths a download worker wrote to ``path``: [] when none (an older worker), or
    when the file is not a JSON list of strings (logged: the download itself worked)."""
    try:
        with os.fdopen(open_regular_file(path), "rb") as fh:
            value = loads_json(fh.read(_MAX_DOWNLOAD_RESULT_BYTES + 1))
    except FileNotFoundError:
        return []
    except (OSError, ParseProblem) as exc:
        log.warning("ignoring the download result %s: %s", path, exc)
        return []
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    log.warning("ignoring the download result %s: not a JSON list of paths", path)
    return []
