"""``rootstock serve``: run one checkpoint's worker for an external i-PI server.

The worker connects to the server's Unix socket as a standard i-PI client (it
never binds), retrying until the server is up. Standard servers send no species,
so ``structure`` names an ASE-readable file that supplies them (and the PBC).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rootstock.errors import UsageError, WorkerError
from rootstock.install.usage import start_session_usage
from rootstock.runtime.session import describe_exit
from rootstock.runtime.spawn import spawn_worker
from rootstock.runtime.spec import resolve_worker_spec


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
    socket_path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    cluster: str | None = None,
    cache_root: str | os.PathLike | None = None,
    device: str = "cuda",
    setup_kwargs: dict[str, Any] | None = None,
    weights: str | os.PathLike | None = None,
    structure: str | os.PathLike | None = None,
    connect_timeout: float | None = None,
) -> ServeResult:
    """Serve ``checkpoint`` on ``socket_path`` until the server finishes.

    The worker's output goes to stderr (or ``$ROOTSTOCK_WORKER_LOG``). Raises
    :class:`WorkerError` when the worker ends with a non-zero status.
    """
    spec = resolve_worker_spec(
        checkpoint,
        root=root,
        cluster=cluster,
        cache_root=cache_root,
        device=device,
        setup_kwargs=setup_kwargs,
        weights=weights,
    )
    socket_file = Path(socket_path).expanduser().absolute()
    if not socket_file.parent.is_dir():
        raise UsageError(
            f"the socket's directory {socket_file.parent} does not exist",
            hint="pass the path the i-PI server binds, e.g. /tmp/ipi_NAME for address NAME",
        )
    structure_file = None
    if structure is not None:
        structure_file = Path(structure).expanduser().absolute()
        if not structure_file.is_file():
            raise UsageError(f"structure file {structure_file} does not exist")
    process = spawn_worker(
        spec.layout,
        spec.env_name,
        checkpoint=spec.checkpoint,
        socket_path=socket_file,
        mode="serve",
        device=spec.device,
        setup_kwargs=spec.setup_kwargs,
        weights=spec.weights,
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


@contextlib.contextmanager
def _forward_sigterm(pid: int):
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
