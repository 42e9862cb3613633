"""``rootstock serve``: run one checkpoint's worker for an external i-PI server.

The worker connects to the server's Unix socket as a standard i-PI client (it
never binds), retrying until the server is up. Standard servers send no species,
so ``structure`` (required) names an ASE-readable file that supplies them (and the
PBC).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rootstock.errors import UsageError, WorkerError
from rootstock.install.usage import start_session_usage
from rootstock.names import device_name
from rootstock.runtime import WorkerOptions, describe_exit, resolve_worker_spec, spawn_worker

# Linux's sockaddr_un.sun_path is 108 bytes, the last of them the terminating NUL;
# connect() on a longer path fails inside the worker, after the model is loaded.
SUN_PATH_MAX_BYTES = 107


@dataclass(frozen=True)
class ServeResult:
    """How a served session ended."""

    checkpoint: str
    env_name: str
    socket: str
    worker_pid: int
    exit_code: int


def serve(
    checkpoint: str,
    socket_path: str | os.PathLike[str],
    options: WorkerOptions,
    *,
    structure: str | os.PathLike[str] | None = None,
    connect_timeout: float | None = None,
    pool: bool = False,
) -> ServeResult:
    """Serve ``checkpoint`` on ``socket_path`` until the server finishes.

    ``options`` says where the install is and how to run the model. The worker's
    output goes to stderr (or ``$ROOTSTOCK_WORKER_LOG``). Raises
    :class:`WorkerError` when the worker ends with a non-zero status; a device
    string or socket path that can never work is a :class:`UsageError` before the
    install is read or anything is started. A missing ``structure`` is one too,
    raised before the worker starts: standard servers send no species.

    With ``pool``, this process is the server's client, and it computes through the
    user's pooled worker for the checkpoint (:func:`serve_pooled`): several ``serve``
    processes (i-PI drivers) then share one warm worker, which merges their calls
    into one model batch when the env has an ``evaluate_batch`` hook.
    """
    device = device_name(options.device)
    socket_file = check_socket_path(socket_path)
    spec = resolve_worker_spec(checkpoint, replace(options, device=device))
    if not socket_file.parent.is_dir():
        raise UsageError(
            f"the socket's directory {socket_file.parent} does not exist",
            hint="pass the path the i-PI server binds, e.g. /tmp/ipi_NAME for address NAME",
        )
    if structure is None:
        # Refused here, not at the first POSDATA: the worker would exit 1 there and
        # leave the server waiting for a client that never comes back.
        raise UsageError(
            "no --structure: a standard i-PI server sends no species, so the worker "
            "could not compute anything it is sent",
            hint="pass --structure FILE, an ASE-readable file with the species and PBC "
            "(the server must send the atoms in the file's order)",
        )
    structure_file = Path(structure).expanduser().absolute()
    if not structure_file.is_file():
        raise UsageError(f"structure file {structure_file} does not exist")
    if pool:
        return serve_pooled(checkpoint, socket_file, options, structure_file, connect_timeout)
    process = spawn_worker(
        spec,
        socket_path=socket_file,
        mode="serve",
        structure=structure_file,
        output="stderr",
        connect_timeout=connect_timeout,
    )
    # The worker talks to the i-PI server directly: rootstock never sees the force
    # calls, so the record has none (force_calls null).
    usage = start_session_usage(
        spec.layout.usage_dir, spec.env_name, spec.checkpoint, spec.device, "serve"
    )
    usage.force_calls, usage.connected = None, True
    with _forward_sigterm(process.pid):
        try:
            code = process.popen.wait()
        except BaseException:
            # Ctrl-C: the worker has its own process group, so pass the interrupt on.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGINT)
            process.stop(grace=5.0)
            raise
        finally:
            process.stop(grace=0.0)
            process.cleanup()
            usage.finish()
    if code != 0:
        raise WorkerError(
            f"the worker for {checkpoint!r} {describe_exit(code)}",
            hint="its output is above; run with ROOTSTOCK_WORKER_LOG=FILE to keep it",
        )
    return ServeResult(checkpoint, spec.env_name, str(socket_file), process.pid, code)


def serve_pooled(
    checkpoint: str,
    socket_file: Path,
    options: WorkerOptions,
    structure_file: Path,
    connect_timeout: float | None,
) -> ServeResult:
    """Be the i-PI server's client here, computing through the pooled worker.

    The worker's own i-PI loop (:class:`rootstock.worker.loop.ServeLoop`) answers
    the server, with a pooled :class:`RootstockCalculator` as its model: the
    structure file gives the species and PBC, each POSDATA becomes one single call
    (a batched POSDATA, one per bead), and a model error ends the session as it does
    for a worker of its own (the connection closes, so the server stops).
    """
    from ase.io import read

    from rootstock.runtime import RootstockCalculator
    from rootstock.wire.framing import FrameStream
    from rootstock.worker.loop import ServeLoop
    from rootstock.worker.main import connect
    from rootstock.worker.model import ModelRunner

    template = read(structure_file)
    calc = RootstockCalculator(
        checkpoint,
        root=options.root,
        cluster=options.cluster,
        cache_root=options.cache_root,
        device=options.device,
        setup_kwargs=options.setup_kwargs,
        weights=options.weights,
        pool=True,
    )
    with calc:
        # Attach now, so a model that cannot start fails before the server waits on us.
        calc.get_potential_energy(template.copy())
        runner = ModelRunner(calc, model_dtype="unknown", model_device=None)
        runner.use_template(template)
        stream = FrameStream(connect(str(socket_file), connect_timeout), peer="server")
        try:
            code = ServeLoop(stream, runner, inband_errors=False).run()
        finally:
            stream.close()
        pid = calc.worker_pid
    if code != 0:
        raise WorkerError(
            f"the pooled worker for {checkpoint!r} failed a calculation; the server's "
            "connection was closed",
            hint="the model's error is above",
        )
    return ServeResult(checkpoint, calc.spec.env_name, str(socket_file), pid or 0, code)


def check_socket_path(socket_path: str | os.PathLike[str]) -> Path:
    """``socket_path`` made absolute, if a Unix socket can have that address.

    The worker connects to the absolute path, so that is what must fit in
    ``sun_path``: at most :data:`SUN_PATH_MAX_BYTES` bytes. Raises
    :class:`UsageError` saying the limit and the length otherwise.
    """
    text = os.fspath(socket_path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise UsageError("--socket cannot be empty", hint="e.g. --socket /tmp/ipi_NAME")
    if "\0" in text:
        raise UsageError(f"--socket {text!r} contains a NUL byte", hint="e.g. /tmp/ipi_NAME")
    socket_file = Path(text).expanduser().absolute()
    length = len(os.fsencode(socket_file))
    if length > SUN_PATH_MAX_BYTES:
        short = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
        raise UsageError(
            f"the socket path {socket_file} is {length} bytes; a Unix socket path is at "
            f"most {SUN_PATH_MAX_BYTES} bytes (sun_path holds {SUN_PATH_MAX_BYTES + 1} "
            "with the terminating NUL)",
            hint=f"bind the server in a shorter directory, e.g. {short}/ipi_NAME",
        )
    return socket_file


@contextlib.contextmanager
def _forward_sigterm(pid: int) -> Iterator[None]:
    """While serving, a SIGTERM (scheduler, timeout) also reaches the worker's group."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
