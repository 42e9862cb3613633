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
:class:`~rootstock.wire.lifeline.Lifeline` (its fd in ``$ROOTSTOCK_LIFELINE_FD``):
when the spawning process is gone, however it died, the worker exits within
moments, even in the middle of a calculation.

Every other process that runs a model or rootstock's worker-side code starts here
too, through :func:`start_process`: the benchmark's in-env probe
(:func:`spawn_env_script`, the env's interpreter with a worker's environment and a
lifeline) and the pool daemon (``runtime/pool/client.py``: this Python, detached).
What differs between them is a :class:`StartOptions`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rootstock.errors import EnvNotFound, WorkerError
from rootstock.install.parsing import NotRegularFile, ParseProblem, loads_json, open_regular_file
from rootstock.runtime.server import make_private_dir
from rootstock.runtime.stage import GENERATION_ENV, Stage, stage_for_worker, stage_mode
from rootstock.runtime.weights_watch import check_weights_at_start
from rootstock.runtime.worker_env import worker_environment
from rootstock.wire.framing import CHECK_DEVICE_ENV, DOWNLOAD_RESULT_ENV
from rootstock.wire.lifeline import LIFELINE_ENV, Lifeline, script_command

if TYPE_CHECKING:
    from rootstock.install.layout import InstallLayout
    from rootstock.runtime.spec import WorkerSpec

log = logging.getLogger("rootstock.runtime")

WORKER_MODULE = "rootstock.worker"
WORKER_LOG_ENV = "ROOTSTOCK_WORKER_LOG"
LOG_FILE_NAME = "worker.log"
#: In a download's run dir: the paths its ``download()`` hook returned (JSON).
DOWNLOAD_RESULT_FILE = "download-result.json"

# The download result is a list of paths.
_MAX_DOWNLOAD_RESULT_BYTES = 1 << 20
# How much of a failed download's output its log keeps (the end of it).
_MAX_DOWNLOAD_LOG_BYTES = 4 << 20


@dataclass(frozen=True)
class StartOptions:
    """What differs between the processes that run a model or rootstock's worker-side
    code: a worker, the benchmark's in-env probe, the pool daemon.

    Whatever they say, the process reads ``/dev/null``, inherits no descriptor but
    the lifeline's, and leads a session (a process group) of its own: Ctrl-C in the
    user's terminal does not hit it mid-frame, and stopping it can kill everything
    the model started.
    """

    #: Its whole environment (a worker's comes from :func:`worker_environment`);
    #: None: this process's own (the pool daemon runs this Python).
    env: Mapping[str, str] | None = None
    #: Where its output goes: a descriptor (the caller's, closed by the caller), 1 or 2.
    stdout: int = subprocess.DEVNULL
    #: A descriptor, or ``subprocess.STDOUT`` to share ``stdout``.
    stderr: int = subprocess.STDOUT
    #: The child's read end is passed down, and dropped here once the child runs.
    #: None: the process holds no lifeline of ours (the pool daemon outlives us).
    lifeline: Lifeline | None = None


def start_process(argv: Sequence[str], options: StartOptions) -> subprocess.Popen:
    """Start ``argv`` as ``options`` say: the one place a process that runs a model or
    rootstock's worker-side code is started. Raises OSError when it cannot start
    (the caller knows what to suggest)."""
    lifeline = options.lifeline
    popen = subprocess.Popen(
        list(argv),
        env=None if options.env is None else dict(options.env),
        stdin=subprocess.DEVNULL,
        stdout=options.stdout,
        stderr=options.stderr,
        close_fds=True,
        pass_fds=() if lifeline is None else (lifeline.child_fd,),
        # Own group: Ctrl-C in the user's script does not hit the worker mid-frame,
        # and stop() can kill everything the model started.
        start_new_session=True,
    )
    if lifeline is not None:
        lifeline.child_started()
    return popen


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
        stage: Stage | None = None,
    ) -> None:
        self.popen = popen
        self.output = output
        self.log_path = log_path
        self.log_offset = log_offset
        self._owned_dir = owned_dir
        # Held (never written) for as long as the worker may live: our exit closes it.
        self.lifeline = lifeline
        # The node-local stage it runs from, held in use while it may live.
        self.stage = stage

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def staged(self) -> str | None:
        """How it was started: "mount" or "copy" (a node-local stage), None (the shared
        env); None too once it has ended and let its stage go."""
        return self.stage.mode if self.stage is not None else None

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
        self._release_stage()
        return self.popen.returncode

    def _cut_lifeline(self) -> None:
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None

    def _release_stage(self) -> None:
        # Only once the worker is gone: an unused mount may then be unmounted.
        if self.stage is not None and self.has_exited():
            self.stage.release()
            self.stage = None

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
        self._release_stage()
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
    python: Path | None = None,
    socket_path: Path | str,
    mode: str,
    structure: Path | None = None,
    connect_timeout: float | None = None,
    debug: bool = False,
) -> list[str]:
    """The argv of a worker for ``spec``, run by its env's interpreter (``python``: the
    one of its stage).

    ``-I`` keeps the caller's cwd and PYTHON* settings out.
    """
    argv = [
        str(python or spec.python),
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
    if mode != "download":
        # A stat per recorded weight file; warns and marks, never refuses.
        check_weights_at_start(layout, env_name, spec.checkpoint)
    # The download phase (add, sync) is a fetch on a login node: nothing to stage for.
    staging = "off" if mode == "download" else stage_mode(spec.stage)
    stage = stage_for_worker(layout, env_name, staging)
    python = stage.python if stage is not None else spec.python
    if stage is None and not python.exists():
        raise EnvNotFound(
            f"env {env_name!r} has no interpreter at {python}",
            hint=f"rebuild it with `rootstock install {env_name} --force`",
        )
    target = os.environ.get(WORKER_LOG_ENV) or output or "capture"
    lifeline = Lifeline()
    argv = worker_command(
        spec,
        python=python,
        socket_path=socket_path,
        mode=mode,
        structure=structure,
        connect_timeout=connect_timeout,
        debug=logging.getLogger("rootstock.wire").isEnabledFor(logging.DEBUG),
    )
    try:
        env = worker_environment(
            layout, env_name, offline=offline, prefix=stage.prefix if stage else None
        )
        if stage is not None:
            env[GENERATION_ENV] = str(stage.generation)
        env[LIFELINE_ENV] = str(lifeline.child_fd)
        if spec.check_device:
            env[CHECK_DEVICE_ENV] = "1"
        env.update(extra_env or {})
        stdout, stderr, log_path, offset, owned = _open_output(target, run_dir)
    except BaseException:
        lifeline.close()
        if stage is not None:
            stage.release()
        raise
    try:
        popen = start_process(
            argv, StartOptions(env=env, stdout=stdout, stderr=stderr, lifeline=lifeline)
        )
    except BaseException as exc:
        lifeline.close()
        if stage is not None:
            stage.release()
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
    log.debug("spawned worker pid %d: %s (output: %s)", popen.pid, " ".join(argv), target)
    return WorkerProcess(popen, target, log_path, offset, owned, lifeline, stage)


def spawn_env_script(
    spec: WorkerSpec, script: Path, args: Sequence[str], *, log_path: Path
) -> WorkerProcess:
    """Run the Python file ``script`` with ``args`` in ``spec``'s env, as a worker runs.

    The env's own interpreter (``-I``) and the environment a worker gets (offline),
    its output appended to ``log_path`` (a 0600 file). The script runs by path under
    the lifeline runner, so it dies with this process like a worker, and an env built
    by an older rootstock needs nothing new. Raises :class:`WorkerError` when the
    env's Python cannot be started. The benchmark's in-env probe runs this way.
    """
    lifeline = Lifeline()
    try:
        argv = script_command(str(spec.python), lifeline.child_fd, str(script), list(args))
        env = worker_environment(spec.layout, spec.env_name, offline=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except BaseException:
        lifeline.close()
        raise
    try:
        popen = start_process(argv, StartOptions(env=env, stdout=fd, lifeline=lifeline))
    except OSError as exc:
        lifeline.close()
        raise WorkerError(
            f"cannot run the env's Python {spec.python}: {exc}",
            hint=f"rebuild the env: rootstock install {spec.env_name} --force",
        ) from None
    finally:
        os.close(fd)
    return WorkerProcess(popen, "capture", log_path, lifeline=lifeline)


def run_download(
    layout: InstallLayout,
    env_name: str,
    *,
    checkpoint: str,
    setup_kwargs: dict[str, Any] | None = None,
    timeout: float = 3600.0,
    gated_url: str | None = None,
) -> list[str]:
    """Run the fetch phase of ``add``: a worker in ``download`` mode, CPU, network on.

    Returns the absolute paths the env's ``download()`` hook returned (empty when it
    returned none, when ``setup()`` did the fetch, or when the env's worker is from
    an older rootstock, which knows no result file). Raises
    :class:`~rootstock.runtime.download_failure.DownloadFailed`, naming the cause and
    the fix and the log file with the worker's whole output, when the env's
    ``download()`` (or ``setup()``) fails, or when it runs past ``timeout``.
    ``gated_url`` (the checkpoint's ``CHECKPOINT_INFO`` ``gated``): then a run with no
    Hugging Face token is refused before the worker starts, and a hub's 401 or 403 is
    said the same way (:func:`~rootstock.runtime.download_failure.gated_message`).
    """
    from rootstock.runtime.download_failure import download_failure, require_hf_token

    if gated_url:
        require_hf_token(checkpoint, gated_url)
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
        if not finished or code != 0:
            raise download_failure(
                layout,
                env_name,
                checkpoint,
                output=process.output_tail(max_bytes=_MAX_DOWNLOAD_LOG_BYTES, max_lines=10**6),
                exit_code=code if finished else None,
                timeout=timeout,
                timed_out=not finished,
                gated_url=gated_url,
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
