"""The client side of the user's worker pool: find or start a daemon, attach to it.

:func:`ensure_daemon` connects to the daemon of a worker key, or starts one. The
start is race-free: it happens under an fcntl lock per key in the pool directory,
so two processes attaching at once end with one daemon (the second waits for the
lock, then finds the first one's socket). :func:`attach` returns a
:class:`PoolSession`, a :class:`~rootstock.runtime.session.WorkerSession` whose
stream goes to the daemon instead of a worker of its own; ``compute`` and
``compute_batch`` work over it unchanged, and ``close()`` only disconnects.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rootstock.errors import (
    ProtocolError,
    RootstockError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeout,
)
from rootstock.runtime.pool.daemon import DEFAULT_IDLE_TIMEOUT, START_MARK
from rootstock.runtime.pool.directory import (
    PoolFileError,
    PoolFiles,
    daemon_alive,
    ensure_pool_dir,
    open_pool_file,
    read_json,
)
from rootstock.runtime.pool.relay import RELAY_VERSION, encode_deadline
from rootstock.runtime.server import peer_uid
from rootstock.runtime.session import WorkerSession
from rootstock.runtime.spawn import StartOptions, start_process
from rootstock.runtime.spec import WorkerSpec
from rootstock.runtime.worker_keys import WorkerKey
from rootstock.wire.framing import EXIT, READY, STATUS, ErrorReply, FrameStream, PeerClosed

POLL_S = 0.05
# A pooled call waits this long past its timeout for the daemon's own verdict
# (the daemon enforces the caller's timeout and says what it did).
VERDICT_GRACE_S = 10.0

_Reply = TypeVar("_Reply")
# A daemon that answers STATUS slower than this is not ready (or not a daemon).
HANDSHAKE_S = 10.0
DAEMON_MODULE = "rootstock.runtime.pool.daemon"


@dataclass(frozen=True)
class DaemonInfo:
    """A running daemon as its state file describes it."""

    digest: str
    daemon_pid: int | None
    worker_pid: int | None
    state: dict[str, Any]


def _check_daemon_uid(conn: socket.socket) -> None:
    """Refuse a socket that another user's process is listening on."""
    uid = peer_uid(conn)
    if uid is not None and uid != os.getuid():
        conn.close()
        raise ProtocolError(f"refused the pool socket: it is served by uid {uid}, not by you")


def _connect(files: PoolFiles) -> FrameStream | None:
    """A stream to the key's daemon after a STATUS handshake, or None if there is none."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(files.socket))
    except OSError as exc:
        conn.close()
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
            return None
        raise ProtocolError(f"cannot connect to the pool socket {files.socket}: {exc}") from None
    _check_daemon_uid(conn)
    stream = FrameStream(conn, peer=f"pool daemon {files.digest}")
    try:
        stream.set_deadline(HANDSHAKE_S)
        stream.send(STATUS)
        answer = stream.read_bytes(len(READY))
    except ProtocolError:
        # A daemon that was just leaving (idle or stale) closed on us: start afresh.
        stream.close()
        return None
    if answer != READY:
        stream.close()
        raise ProtocolError(f"the pool daemon {files.digest} answered STATUS with {answer!r}")
    return stream


def daemon_info(files: PoolFiles) -> DaemonInfo:
    """What the key's state file says (pids may be None while it is being written)."""
    state = read_json(files.state) or {}
    daemon = state.get("daemon") if isinstance(state.get("daemon"), dict) else {}
    pid = daemon.get("pid") if isinstance(daemon, dict) else None
    worker = state.get("worker_pid")
    return DaemonInfo(
        files.digest,
        pid if isinstance(pid, int) else None,
        worker if isinstance(worker, int) else None,
        state,
    )


@contextlib.contextmanager
def _start_lock(files: PoolFiles, deadline: float | None) -> Any:
    fd = open_pool_file(files.lock, os.O_RDWR | os.O_CREAT)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorkerTimeout(
                        f"another process has been starting the pooled worker {files.digest} "
                        "for longer than the timeout",
                        hint="pass a larger timeout=, or see `rootstock workers list`",
                    ) from None
                time.sleep(POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _spawn_daemon(
    spec: WorkerSpec, files: PoolFiles, timeout: float | None, idle_timeout: float
) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        DAEMON_MODULE,
        "--spec",
        spec.to_json(),
        "--digest",
        files.digest,
        "--pool-dir",
        str(files.directory),
        "--idle-timeout",
        repr(float(idle_timeout)),
        "--startup-timeout",
        repr(float(timeout or 0.0)),
    ]
    log_fd = open_pool_file(files.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        # Detached: it outlives this process, and holds none of its lifelines
        # (close_fds), so only its own worker is tied to it.
        return start_process(argv, StartOptions(stdout=log_fd))
    finally:
        os.close(log_fd)


def _log_tail(files: PoolFiles, max_bytes: int = 4096) -> str:
    """The end of the key's log, from the last daemon's start on (never an earlier one's)."""
    try:
        with os.fdopen(open_pool_file(files.log, os.O_RDONLY), "rb") as fh:
            fh.seek(max(fh.seek(0, os.SEEK_END) - max_bytes, 0))
            text = fh.read().decode("utf-8", "replace")
    except (OSError, PoolFileError):
        return ""
    start = text.rfind(START_MARK)
    if start < 0:
        return text
    return text[text.rfind("\n", 0, start) + 1 :]


def _setup_failure(spec: WorkerSpec, files: PoolFiles) -> WorkerError | None:
    data = read_json(files.error)
    if data is None:
        return None
    with contextlib.suppress(FileNotFoundError):
        files.error.unlink()
    kind = data.get("type")
    if kind == "WorkerDiedError":
        # The worker died while loading the model: its own exit status and output.
        code = data.get("exit_code")
        return WorkerDiedError(
            str(data.get("message", "")),
            worker_exit_code=code if isinstance(code, int) else None,
            output_tail=str(data.get("output_tail", "")),
        )
    if kind == "WorkerTimeout":
        hint = data.get("hint")
        return WorkerTimeout(
            str(data.get("message", "")), hint=hint if isinstance(hint, str) else None
        )
    reply = ErrorReply(
        type=str(data.get("type", "Exception")),
        message=str(data.get("message", "")),
        traceback=str(data.get("traceback", "")),
        phase=str(data.get("phase", "setup")),
    )
    # The same wording as a worker of one's own (a session that never starts, and so
    # records no usage): the message names the model's error.
    probe = WorkerSession(spec, timeout=None)
    return WorkerError(
        probe._error_message(reply), remote_traceback=reply.traceback, hint=probe._error_hint(reply)
    )


def _wait_started(
    spec: WorkerSpec, files: PoolFiles, popen: subprocess.Popen, deadline: float | None
) -> FrameStream:
    while True:
        code = popen.poll()
        if code is not None:
            failure = _setup_failure(spec, files)
            if failure is not None:
                raise failure
            raise WorkerDiedError(
                f"the pool daemon for {spec.checkpoint!r} (env {spec.env_name}) exited with "
                f"code {code} while starting (its log: {files.log})",
                worker_exit_code=code,
                output_tail=_log_tail(files),
            )
        if files.socket.exists():
            stream = _connect(files)
            if stream is not None:
                return stream
        if deadline is not None and time.monotonic() >= deadline:
            _stop_process(popen)
            raise WorkerTimeout(
                f"the pooled worker for {spec.checkpoint!r} did not load the model and "
                "get ready within the timeout, and was stopped",
                hint="pass a larger timeout= (or None) for slow models or slow filesystems",
            )
        time.sleep(POLL_S)


def _stop_process(popen: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(5.0)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()


def ensure_daemon(
    spec: WorkerSpec,
    key: WorkerKey,
    *,
    timeout: float | None,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
) -> tuple[FrameStream, PoolFiles]:
    """A connected stream to the daemon for ``key``, starting the daemon if needed.

    Waits (within ``timeout`` seconds; None: as long as it takes) for its worker to
    load the model. A worker whose ``setup()`` failed raises :class:`WorkerError`
    with the model's traceback; the daemon has exited by then.
    """
    files = PoolFiles(ensure_pool_dir(), key.digest)
    deadline = None if timeout is None else time.monotonic() + timeout
    stream = _connect(files)
    if stream is not None:
        return stream, files
    with _start_lock(files, deadline):
        stream = _connect(files)
        if stream is not None:
            return stream, files
        state = read_json(files.state)
        if state is not None and daemon_alive(state) and files.socket.exists():
            raise ProtocolError(
                f"the pool daemon {key.digest} runs but does not answer on {files.socket}",
                hint=f"stop it with `rootstock workers stop {key.digest}`",
            )
        # Under the lock nobody else starts this key: what is left here is a dead one's.
        files.remove_leftovers()
        popen = _spawn_daemon(spec, files, timeout, idle_timeout)
        try:
            return _wait_started(spec, files, popen, deadline), files
        except BaseException as exc:
            if not isinstance(exc, RootstockError) and popen.poll() is None:
                _stop_process(popen)  # Ctrl-C while starting: leave no half-started daemon
            raise


def clean_if_dead(files: PoolFiles) -> bool:
    """Remove a dead daemon's socket and state files; True if they were removed.

    Done under the key's start lock (skipped when someone holds it: a start is in
    progress), and only after the state is read again there, so the files of a
    daemon being started are never removed.
    """
    fd = open_pool_file(files.lock, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        state = read_json(files.state)
        if state is not None and daemon_alive(state):
            return False
        files.remove_leftovers()
        return True
    finally:
        os.close(fd)


class PoolSession(WorkerSession):
    """A session whose worker is the user's pooled worker for the key (see the module)."""

    def __init__(
        self,
        spec: WorkerSpec,
        key: WorkerKey,
        *,
        timeout: float | None,
        allow_nonfinite: bool = False,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    ) -> None:
        super().__init__(spec, timeout=timeout, allow_nonfinite=allow_nonfinite)
        self.key = key
        self.idle_timeout = idle_timeout
        self.files: PoolFiles | None = None
        self.daemon_pid: int | None = None
        self._worker_pid: int | None = None
        self._daemon_record: dict[str, Any] | None = None
        self._sends_deadline = False  # the daemon enforces each call's timeout

    @property
    def pid(self) -> int | None:
        """The pooled worker's process id (not the daemon's)."""
        return self._worker_pid

    def start(self) -> PoolSession:
        """Attach to the key's daemon, starting one if there is none."""
        stream, files = ensure_daemon(
            self.spec, self.key, timeout=self.timeout, idle_timeout=self.idle_timeout
        )
        info = daemon_info(files)
        self.files, self.stream = files, stream
        self.daemon_pid, self._worker_pid = info.daemon_pid, info.worker_pid
        record = info.state.get("daemon")
        self._daemon_record = record if isinstance(record, dict) else None
        relay = info.state.get("relay")
        self._sends_deadline = isinstance(relay, int) and relay >= RELAY_VERSION
        self.usage.connected = True
        # A calculator never closed still leaves its usage record, when it is collected
        # or at exit (the connection closes with the process; the daemon sees EOF).
        self._finalizer = weakref.finalize(self, self.usage.finish)
        return self

    def _check_alive(self) -> None:
        # A dead daemon's socket reads EOF anyway; this catches one that is gone
        # while the kernel still holds the connection (a zombie daemon).
        if self._daemon_record is not None and not daemon_alive({"daemon": self._daemon_record}):
            raise self._died(self._phase())

    def _exchange(
        self,
        stream: FrameStream,
        data: bytes,
        read: Callable[[], _Reply],
        timeout: float | None,
    ) -> _Reply:
        """As for a worker of one's own, but the daemon holds the deadline: it is told
        the timeout with each request, stops a worker that overruns it and says so.
        This client waits a little longer for that verdict before giving up itself."""
        if not self._sends_deadline:
            return self._exchange_alone(stream, data, read, timeout)
        patience = None if timeout is None else timeout + VERDICT_GRACE_S
        return self._exchange_alone(stream, encode_deadline(timeout) + data, read, patience)

    def _exchange_alone(
        self,
        stream: FrameStream,
        data: bytes,
        read: Callable[[], _Reply],
        timeout: float | None,
    ) -> _Reply:
        try:
            return super()._exchange(stream, data, read, timeout)
        except WorkerTimeout:
            raise WorkerTimeout(
                f"the pool daemon for {self.spec.checkpoint!r} (pid {self.daemon_pid}) did "
                f"not answer within {timeout:g} s; this client disconnected, but the pooled "
                f"worker (pid {self._worker_pid}) was not stopped and may still be computing",
                hint=f"`rootstock workers stop {self.key.digest}` stops it; pass a larger "
                "timeout= (or None) for slow models or large systems",
            ) from None

    def _raise_error(self, reply: ErrorReply) -> WorkerError:
        """The daemon's own verdicts (phase ``pool``: it stopped the worker and is
        leaving; ``queue``: this call waited too long for a busy worker) become the
        matching errors; a model's errors are reported as for a worker of one's own."""
        if reply.phase == "queue":
            return WorkerTimeout(
                reply.message, hint="pass a larger timeout=, or start fewer clients per worker"
            )
        if reply.phase != "pool":
            return super()._raise_error(reply)
        self._teardown()  # the daemon is going; the next call attaches afresh
        if reply.type == "WorkerDiedError":
            code = reply.details.get("exit_code")
            return WorkerDiedError(
                reply.message,
                worker_exit_code=code if isinstance(code, int) else None,
                output_tail=str(reply.details.get("output_tail", "")),
            )
        if reply.type == "WorkerTimeout":
            return WorkerTimeout(
                reply.message, hint="pass a larger timeout= (or None) for slow models"
            )
        return WorkerError(reply.message, hint="the next call starts a fresh pooled worker")

    def _died(self, when: str) -> WorkerDiedError:
        self._teardown()
        return WorkerDiedError(
            f"the pooled worker for {self.spec.checkpoint!r} (env {self.spec.env_name}, "
            f"worker pid {self._worker_pid}, pool daemon pid {self.daemon_pid}) closed the "
            f"connection {when}; the next call attaches to a fresh one",
            worker_exit_code=None,
            output_tail=_log_tail(self.files) if self.files is not None else "",
        )

    def close(self, graceful: bool = True) -> None:
        """Leave the pooled worker (it stays up for other clients until its idle timeout)."""
        if not self.owned:
            self._disown()  # a forked child: the connection is the parent's
            return
        if self.stream is not None and graceful:
            with contextlib.suppress(ProtocolError, PeerClosed):
                self.stream.set_deadline(1.0)
                self.stream.send(EXIT)
        self._teardown()


def attach(
    spec: WorkerSpec,
    key: WorkerKey,
    *,
    timeout: float | None,
    allow_nonfinite: bool,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
) -> PoolSession:
    """A started :class:`PoolSession` for ``key`` (the daemon is started if needed)."""
    return PoolSession(
        spec, key, timeout=timeout, allow_nonfinite=allow_nonfinite, idle_timeout=idle_timeout
    ).start()
