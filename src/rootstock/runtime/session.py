"""One live worker seen from the client: process, connection, and what it knows.

A session is started on the first calculation and reused while it is healthy.
Each calculation is one write (INIT when the system changed, POSDATA, GETFORCE)
and one reply. Any failure other than a model exception reported in-band ends
the session: the worker is stopped, and the caller starts a fresh one next time.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from rootstock.errors import (
    DeviceNotVisible,
    ProtocolError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeout,
)
from rootstock.install.usage import SessionUsage, current_entry_point, start_session_usage
from rootstock.runtime.server import WorkerListener
from rootstock.runtime.spawn import WorkerProcess, spawn_worker
from rootstock.runtime.spec import WorkerSpec
from rootstock.wire.batch import BatchReply, BatchRequest, encode_batch, read_batch_reply
from rootstock.wire.framing import (
    EXIT,
    GETFORCE,
    ErrorReply,
    ForceReply,
    FrameStream,
    FrameTimeout,
    PeerClosed,
    PosDataEncoder,
    encode_init,
    read_reply,
)

log = logging.getLogger("rootstock.runtime")

FORWARDED_ARRAYS = ("initial_magmoms", "initial_charges")
# Error types the worker raises itself when a model's results cannot be sent.
MALFORMED_TYPES = ("MalformedResult", "NonFiniteResult")
# How long a worker that closed its connection may take to exit before it is killed.
EXIT_GRACE_S = 2.0

_Reply = TypeVar("_Reply")


# What a worker vendored before batching logs when it receives a BATCH frame.
OLD_WORKER_SIGN = "unknown header b'BATCH"


class Unset:
    """The type of :data:`UNSET`: "not given", where None already means "no limit"."""


UNSET = Unset()


def describe_exit(code: int | None) -> str:
    """A human reading of an exit status (negative: killed by that signal)."""
    if code is None:
        return "is gone (exit status unknown)"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    note = {
        "SIGKILL": " (the out-of-memory killer, the batch scheduler, or kill -9)",
        "SIGSEGV": " (a crash inside the model's native code)",
        "SIGABRT": " (an abort inside the model's native code)",
    }.get(name, "")
    return f"was killed by {name}{note}"


class WorkerSession:
    """A started worker for one :class:`WorkerSpec`."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        timeout: float | None,
        offline: bool = True,
        allow_nonfinite: bool = False,
    ) -> None:
        self.spec = spec
        self.timeout = timeout
        self.offline = offline
        self.allow_nonfinite = allow_nonfinite
        self.process: WorkerProcess | None = None
        self.stream: FrameStream | None = None
        self._listener: WorkerListener | None = None
        self._sent_key: tuple | None = None
        self._posdata = PosDataEncoder()
        self._finalizer: weakref.finalize | None = None
        # Counted per calculation, recorded (if the spool allows) when the session ends.
        self.usage: SessionUsage = start_session_usage(
            spec.layout.usage_dir,
            spec.env_name,
            spec.checkpoint,
            spec.device,
            current_entry_point(),
        )
        # A forked child inherits the connection but must never use or stop the
        # parent's worker.
        self.owner_pid = os.getpid()

    @property
    def owned(self) -> bool:
        """False in a process forked after the worker started."""
        return os.getpid() == self.owner_pid

    @property
    def alive(self) -> bool:
        return self.stream is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> WorkerSession:
        """Spawn the worker and wait until it connects (with liveness checks)."""
        spec = self.spec
        listener = WorkerListener()
        try:
            process = spawn_worker(
                spec,
                socket_path=listener.path,
                mode="calculator",
                offline=self.offline,
                run_dir=listener.run_dir,
            )
        except BaseException:
            listener.cleanup()
            raise
        self.process, self._listener = process, listener
        # If the user never closes the calculator, the worker still goes at exit.
        self._finalizer = weakref.finalize(
            self, _reap, process, listener, self.owner_pid, self.usage
        )
        try:
            conn = listener.accept(self.timeout, on_wait=self._check_alive)
        except WorkerTimeout:
            self.close(graceful=False)
            # The worker runs setup() before it connects, so loading the model counts.
            raise WorkerTimeout(
                f"the worker for {spec.checkpoint!r} did not load the model and connect "
                f"within {self.timeout:g} s and was stopped",
                hint="pass a larger timeout= (or None) for slow models or slow filesystems",
            ) from None
        except BaseException:
            self.close(graceful=False)
            raise
        self.stream = FrameStream(conn, peer=f"worker {process.pid}")
        self.usage.connected = True
        log.info("worker %d started for %s (env %s)", process.pid, spec.checkpoint, spec.env_name)
        return self

    def _check_alive(self) -> None:
        if self.process is not None and self.process.has_exited():
            raise self._died(self._phase())

    def _phase(self) -> str:
        """Where the worker was: it connects only once setup() has returned."""
        if self.stream is None:
            return "while starting up and loading the model (setup)"
        return "during a calculation"

    def _died(self, when: str) -> WorkerDiedError:
        """Stop what is left of a worker that closed its connection; say what happened."""
        process = self.process
        pid = process.pid if process else None
        code, outcome = None, describe_exit(None)
        if process is not None:
            exited = process.wait_exit(EXIT_GRACE_S)
            code = process.stop(grace=0.0)
            outcome = describe_exit(code)
            if not exited and code == -signal.SIGKILL:
                # Our own SIGKILL: blaming the out-of-memory killer would send the
                # user hunting for a memory problem that never happened.
                outcome = (
                    f"closed its connection but did not exit within {EXIT_GRACE_S:g} s, "
                    "so rootstock killed it (SIGKILL)"
                )
        tail = process.output_tail() if process else ""
        self._teardown()
        return WorkerDiedError(
            f"the worker for {self.spec.checkpoint!r} (env {self.spec.env_name}, pid {pid}) "
            f"{outcome} {when}",
            worker_exit_code=code,
            output_tail=tail,
        )

    def compute(
        self,
        atoms: Any,
        info_json: str,
        want_stress: bool,
        extras: tuple[str, ...] = (),
        *,
        timeout: float | Unset | None = UNSET,
    ) -> ForceReply:
        """One calculation: a single write, a single reply. Raises WorkerError subclasses.

        ``extras`` names the ASE extras (``magmoms``, ...) whose values the reply
        should carry; the system is re-sent when they change, as for ``want_stress``.
        ``timeout`` bounds this call (a shared worker serves callers with their own
        timeouts); by default the session's.
        """
        timeout = self.timeout if isinstance(timeout, Unset) else timeout
        if self.stream is None:
            raise ProtocolError("the worker session is closed")
        numbers = atoms.arrays["numbers"]
        arrays = [(n, atoms.arrays[n]) for n in FORWARDED_ARRAYS if n in atoms.arrays]
        key = (
            numbers.tobytes(),
            atoms.pbc.tobytes(),
            info_json,
            want_stress,
            tuple((n, a.tobytes()) for n, a in arrays),
            extras,
        )
        parts: list[Any] = []
        if key != self._sent_key:
            config = {
                "numbers": numbers.tolist(),
                "pbc": atoms.pbc.tolist(),
                "info": json.loads(info_json),
                "stress": want_stress,
                "arrays": {n: np.asarray(a).tolist() for n, a in arrays},
            }
            if extras:
                config["extras"] = list(extras)
            if self.allow_nonfinite:
                config["allow_nonfinite"] = True
            parts.append(encode_init(config))
        parts.extend(self._posdata.parts(atoms.cell.array, atoms.arrays["positions"]))
        parts.append(GETFORCE)

        def read() -> ForceReply | ErrorReply:
            # Sent: the worker now holds this system, whatever it answers.
            self._sent_key = key
            return read_reply(stream, len(numbers))

        stream = self.stream
        reply = self._exchange(stream, b"".join(parts), read, timeout)
        if isinstance(reply, ErrorReply):
            self._sent_key = None
            raise self._raise_error(reply)
        # None marks a serve session, whose calls rootstock never sees: not this one.
        if self.usage.force_calls is not None:
            self.usage.force_calls += 1
        return reply

    def compute_batch(
        self, request: BatchRequest, *, timeout: float | Unset | None = UNSET
    ) -> BatchReply:
        """One chunk of structures: a single ``BATCH`` write, a single ``BATCHREADY`` reply.

        Per-structure failures come back inside the reply; a request that fails as
        a whole (the model's setup, say) raises WorkerError, and deaths and timeouts
        are handled as in :meth:`compute`. The worker's single-call system (the last
        INIT) is unchanged by a batch, so nothing is re-sent afterwards.
        """
        timeout = self.timeout if isinstance(timeout, Unset) else timeout
        if self.stream is None:
            raise ProtocolError("the worker session is closed")
        stream = self.stream
        natoms = [item.natoms for item in request.items]
        try:
            reply = self._exchange(
                stream, encode_batch(request), lambda: read_batch_reply(stream, natoms), timeout
            )
        except WorkerDiedError as exc:
            if OLD_WORKER_SIGN not in exc.output_tail:
                raise
            env = self.spec.env_name
            raise WorkerError(
                f"env {env!r} was built by an older rootstock whose worker has no batched "
                "evaluation (it does not know the BATCH frame)",
                hint=f"rebuild it with `rootstock install {env} --force`, or compute "
                "one structure at a time (atoms.calc = calc)",
            ) from None
        if isinstance(reply, ErrorReply):
            raise self._raise_error(reply)
        if self.usage.force_calls is not None:
            self.usage.force_calls += len(natoms)
        return reply

    def _exchange(
        self,
        stream: FrameStream,
        data: bytes,
        read: Callable[[], _Reply],
        timeout: float | None,
    ) -> _Reply:
        """Send one request and read its reply; a death, timeout or broken frame ends
        the session (the worker is stopped) and raises the matching WorkerError."""
        try:
            stream.set_deadline(timeout, self._check_alive)
            stream.send(data)
            return read()
        except PeerClosed:
            raise self._died(self._phase()) from None
        except FrameTimeout:
            self.close(graceful=False)
            raise WorkerTimeout(
                f"the worker for {self.spec.checkpoint!r} did not answer within "
                f"{timeout:g} s and was stopped",
                hint="pass a larger timeout= (or None) for slow models or large systems",
            ) from None
        except BaseException:
            # A protocol error or Ctrl-C mid-frame leaves the stream unusable.
            self.close(graceful=False)
            raise

    def _raise_error(self, reply: ErrorReply) -> WorkerError:
        """The WorkerError for an in-band ERROR; a setup error also ends the session."""
        if reply.phase == "setup":
            self.close(graceful=True)
        return model_error(self.spec, reply)

    def _error_message(self, reply: ErrorReply) -> str:
        return error_message(self.spec, reply)

    def _error_hint(self, reply: ErrorReply) -> str | None:
        return error_hint(self.spec, reply)

    def close(self, graceful: bool = True) -> None:
        """Ask the worker to exit (EXIT), then stop its process group and clean up."""
        if not self.owned:
            self._disown()
            return
        if self.stream is not None and graceful:
            try:
                self.stream.set_deadline(1.0)
                self.stream.send(EXIT)
            except ProtocolError:
                pass
        if self.process is not None:
            if self.stream is not None:
                self.stream.close()
                self.stream = None
            self.process.stop(grace=3.0 if graceful else 0.0)
        self._teardown()

    def _disown(self) -> None:
        """Forget the parent's worker without touching it (we are a forked child)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self.stream is not None:
            # Closing our copy of the descriptor leaves the parent's connection open.
            self.stream.close()
            self.stream = None
        self.process = None
        self._listener = None

    def _teardown(self) -> None:
        self.usage.finish()
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self._listener is not None:
            self._listener.cleanup()
            self._listener = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None


def model_error(spec: WorkerSpec, reply: ErrorReply, index: int | None = None) -> WorkerError:
    """The WorkerError for a model error; ``index`` names the structure of a batch."""
    if reply.type == DeviceNotVisible.__name__ and reply.phase == "setup":
        return DeviceNotVisible(reply.message)
    message = error_message(spec, reply)
    if index is not None:
        message = f"structure {index}: {message}"
    return WorkerError(message, remote_traceback=reply.traceback, hint=error_hint(spec, reply))


def error_message(spec: WorkerSpec, reply: ErrorReply) -> str:
    """One line naming the checkpoint, the phase and the model's own message.

    The message ends in ``Type: text``, the traceback's own last line, so a
    reader that adds that line (verification does) finds it already there.
    """
    who = f"{spec.checkpoint!r} (env {spec.env_name})"
    if reply.type in MALFORMED_TYPES:
        return f"{who} returned a result that cannot be used: {reply.message}"
    where = "setup()" if reply.phase == "setup" else "the calculation"
    return f"{who} failed in {where}: {reply.type}: {reply.message}"


def error_hint(spec: WorkerSpec, reply: ErrorReply) -> str | None:
    """What to do about a model error (None: the message says it all)."""
    if reply.type == "NonFiniteResult":
        return (
            "the worker is still running; pass allow_nonfinite=True to "
            "RootstockCalculator to receive NaN and inf as they are"
        )
    if reply.type == "MalformedResult":
        return (
            "the worker is still running; the calculator that setup() returns in "
            f"envs/{spec.env_name}/env_source.py must fill ASE's shapes"
        )
    if reply.phase != "setup":
        return None
    if reply.type == "WeightsNotLoaded":
        return (
            f"check that {spec.weights} holds weights this family can load "
            "(same code version, and any keyword it needs in setup_kwargs); the "
            "family's own traceback is below"
        )
    return (
        "the worker's traceback is below; a fix in setup() belongs in "
        f"envs/{spec.env_name}/env_source.py"
    )


def _reap(
    process: WorkerProcess, listener: WorkerListener, owner_pid: int, usage: SessionUsage
) -> None:
    if os.getpid() != owner_pid:
        return  # a forked child: the worker belongs to the parent
    usage.finish()
    # The connection is already gone with the session, so the worker sees EOF and
    # exits on its own; the kill only covers one stuck in the model.
    process.stop(grace=1.0)
    listener.cleanup()
