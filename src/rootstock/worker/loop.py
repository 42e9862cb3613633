"""The worker's side of the conversation: an i-PI client state machine.

The same loop serves rootstock's calculator (which consolidates INIT, POSDATA and
GETFORCE into one write and understands ``ERROR`` replies) and standard i-PI
servers such as ASE's ``SocketIOCalculator`` and i-PI itself (which poll STATUS
and never see ``ERROR``: a model error there is logged and ends the worker, which
closes the connection so the server stops at that step).

A standard server is answered ``NEEDINIT`` until it has sent its INIT: that is
when i-PI (>= 3.3) announces ``batch_size:N``, after which every POSDATA carries
N structures (:mod:`rootstock.worker.ipi_batch`). Rootstock's calculator never
polls STATUS and sends its JSON INIT with the first POSDATA; its ``BATCH`` frames
go to :func:`rootstock.worker.batch.run_batch`.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rootstock.errors import ProtocolError
from rootstock.wire.batch import BatchRequest
from rootstock.wire.framing import (
    HAVEDATA,
    NEEDINIT,
    READY,
    FrameStream,
    Init,
    PeerClosed,
    PosData,
    encode_error,
    encode_forceready,
)
from rootstock.worker.batch import evaluate_items, run_batch
from rootstock.worker.ipi_batch import (
    BatchedPosData,
    encode_batched_forceready,
    evaluate_batched,
    init_batch_size,
    read_server_message,
)
from rootstock.worker.merge import MergeRequest, run_merge
from rootstock.worker.model import MalformedResult, ModelRunner

log = logging.getLogger("rootstock.worker")

EXIT_OK = 0
EXIT_MODEL_ERROR = 1
EXIT_PROTOCOL_ERROR = 3


@dataclass
class CapturedError:
    """An exception from the model, kept until the next GETFORCE can report it."""

    type: str
    message: str
    traceback: str
    phase: str

    @classmethod
    def current(cls, exc: BaseException, phase: str) -> CapturedError:
        """Capture ``exc``; a malformed result keeps no traceback (it would show only
        the worker's own check, never the model's code)."""
        if isinstance(exc, MalformedResult):
            return cls(type(exc).__name__, str(exc), "", phase)
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(type(exc).__name__, str(exc), text, phase)

    def log_text(self) -> str:
        """What the worker's log says about this error."""
        if not self.traceback:
            return f"{self.type}: {self.message}"
        return self.traceback.rstrip()

    def frame(self) -> bytes:
        return encode_error(self.type, self.message, self.traceback, self.phase)


class ServeLoop:
    """Answer one server until it says EXIT or closes the connection.

    ``batch_hook`` is the env's ``evaluate_batch(calc, atoms_list, properties)``,
    or None: rootstock's ``BATCH`` frames and i-PI's batched POSDATA use it.
    """

    def __init__(
        self,
        stream: FrameStream,
        runner: ModelRunner | None,
        *,
        inband_errors: bool,
        setup_error: CapturedError | None = None,
        body_timeout: float = 120.0,
        batch_hook: Callable[..., Any] | None = None,
    ) -> None:
        self.stream = stream
        self.runner = runner
        self.inband_errors = inband_errors
        self.setup_error = setup_error
        self.body_timeout = body_timeout
        self.batch_hook = batch_hook
        self._reply: bytes | None = None
        self._error: CapturedError | None = None
        self._have_data = False
        self._initialised = False
        # Structures per POSDATA, as the standard server's INIT announced (i-PI).
        self.ipi_batch_size = 1
        if runner is not None:
            runner.merge_ready = inband_errors and batch_hook is not None

    def run(self) -> int:
        """Serve until EXIT or EOF; return the worker's exit code."""
        while True:
            self.stream.set_deadline(None)
            try:
                message = read_server_message(self.stream, self.body_timeout, self.ipi_batch_size)
            except PeerClosed:
                log.debug("the server closed the connection")
                return EXIT_OK
            if isinstance(message, PosData | BatchedPosData):
                self._on_posdata(message)
            elif isinstance(message, Init):
                self._on_init(message)
            elif message == "STATUS":
                self.stream.send(self._status())
            elif message == "GETFORCE":
                code = self._on_getforce()
                if code is not None:
                    return code
            elif message == "EXIT":
                log.debug("EXIT received")
                return EXIT_OK
            elif isinstance(message, BatchRequest):
                code = self._on_batch(message)
                if code is not None:
                    return code
            elif isinstance(message, MergeRequest):
                code = self._on_merge(message)
                if code is not None:
                    return code

    def _status(self) -> bytes:
        if self._have_data:
            return HAVEDATA
        if not self.inband_errors and not self._initialised:
            # A standard server sends INIT only when asked to, and a batching i-PI
            # says in it how many structures each POSDATA will carry.
            return NEEDINIT
        # READY even without species: a standard server then sends POSDATA, and the
        # reply to it explains that --structure is missing (NEEDINIT would loop).
        if self.setup_error is None and self.runner is not None:
            return READY
        return NEEDINIT

    def _on_init(self, init: Init) -> None:
        self._initialised = True
        config = init.dialect_config()
        if config is None:
            self.ipi_batch_size = init_batch_size(init)
            if self.ipi_batch_size > 1:
                log.info("batched mode: %d structures per POSDATA", self.ipi_batch_size)
            else:
                log.debug("standard INIT (%d bytes) ignored", len(init.payload))
            return
        if self.runner is None:
            return
        try:
            self.runner.configure(config)
        except Exception as exc:
            self._error = CapturedError.current(exc, "init")

    def _on_posdata(self, pos: PosData | BatchedPosData) -> None:
        self._have_data = True
        self._reply = None
        if self.setup_error is not None or self._error is not None or self.runner is None:
            return
        try:
            if isinstance(pos, BatchedPosData):
                results = evaluate_batched(self.runner, self.batch_hook, pos)
                self._reply = encode_batched_forceready(results)
            else:
                self._reply = encode_forceready(*self.runner.compute(pos.cell, pos.positions))
        except Exception as exc:
            self._error = CapturedError.current(exc, "calculate")

    def _on_batch(self, request: BatchRequest) -> int | None:
        """A rootstock BATCH: one BATCHREADY (or ERROR) reply; single-call state is kept."""
        if self.setup_error is not None:
            self.stream.send(self.setup_error.frame())
            return EXIT_MODEL_ERROR
        if self.runner is None:
            self.stream.send(
                encode_error("RuntimeError", "the worker has no model to run", "", "calculate")
            )
            return None
        self.stream.send(run_batch(self.runner, self.batch_hook, request))
        return None

    def _on_merge(self, request: MergeRequest) -> int | None:
        """The pool daemon's merged single calls: one reply per call, in order."""
        count = len(request.calls)
        if self.setup_error is not None:
            self.stream.send(self.setup_error.frame() * count)
            return EXIT_MODEL_ERROR
        if self.runner is None or self.batch_hook is None:
            # Never advertised: a daemon that sends it anyway is out of step.
            raise ProtocolError("RSMERGE arrived, but this worker has no evaluate_batch hook")
        replies = run_merge(self.runner, self.batch_hook, request, evaluate_items)
        self.stream.send(b"".join(replies))
        return None

    def _on_getforce(self) -> int | None:
        if not self._have_data:
            raise ProtocolError("GETFORCE arrived before any POSDATA")
        self._have_data = False
        error = self.setup_error or self._error
        self._error = None
        if error is None and self._reply is not None:
            self.stream.send(self._reply)
            self._reply = None
            return None
        if error is None:
            raise ProtocolError("no result to send")
        if not self.inband_errors:
            # A standard server has no error frame: closing the connection (the caller
            # does, on return) stops it at this step instead of integrating garbage.
            log.error(
                "the model failed during %s; closing the connection:\n%s",
                error.phase,
                error.log_text(),
            )
            return EXIT_MODEL_ERROR
        self.stream.send(error.frame())
        if error.phase == "setup":
            return EXIT_MODEL_ERROR
        return None
