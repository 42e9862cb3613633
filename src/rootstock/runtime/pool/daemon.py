"""The pool daemon: one warm worker shared by the user's processes on a node.

``python -m rootstock.runtime.pool.daemon --spec JSON --digest D ...`` is started by
:func:`rootstock.runtime.pool.client.ensure_daemon`, detached (its own session,
stdin /dev/null, output to ``<digest>.log`` in the pool directory). It spawns the
worker as any session does (the worker never binds, and holds the daemon's
lifeline, so a killed daemon takes its worker along), checks that ``setup()``
worked, then binds ``<digest>.sock`` (0600) and relays.

Each client speaks the worker protocol. The daemon keeps every client's last
``INIT``, and under one worker lock decides whether the worker's current system is
someone else's and, if so, sends that client's ``INIT`` ahead of its
``POSDATA``+``GETFORCE`` (deciding outside the lock would let another client's
system slip in between); the reply goes back byte for byte. ``BATCH`` frames go
through whole and leave the worker's system as it was. ``STATUS`` is answered here
(``READY``), ``RSDEADLINE`` sets the caller's timeout for its next request, and
``EXIT`` means that client leaves.

Requests queue in arrival order, and the client thread that finds the worker free
takes the next turn for the head of the queue (there is no dispatcher thread, so a
lone call pays no hand-off). Where the worker takes ``RSMERGE`` (its model report
says ``"merge": true``), a turn merges the waiting single calls into one, and the
worker answers each as if it had come alone (:mod:`rootstock.runtime.pool.merging`
says which calls a turn takes; docs/protocol.md, "In-flight batching").

What a client sends is checked before the shared worker sees it: an ``INIT`` that
is not the dialect's JSON, or a ``BATCH`` whose body does not decode, is answered
with an ``ERROR`` to that client alone. What the worker answers is checked against
the request (the atom count, a size bound) and read under the caller's deadline.
A worker that breaks the protocol, overruns a caller's deadline or dies is
stopped; the clients waiting for it get an ``ERROR`` of phase ``pool`` that says
why (with the worker's own exit status and output where it died), and the daemon
exits.

The daemon exits when its idle timeout passes with no client, when it is told to
stop (SIGTERM), when the worker dies (every client then sees its connection
close), or, once its env was rebuilt or hotfixed (the worker key changed), as soon
as its last client has gone; from the moment it knows it is stale it takes no new
client (its socket is unlinked).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import logging
import math
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rootstock.errors import ProtocolError, RootstockError, WorkerDiedError, WorkerError
from rootstock.runtime.pool.directory import (
    STATE_SCHEMA,
    PoolFiles,
    check_private_dir,
    read_json,
    utc_now,
    write_json_atomic,
)
from rootstock.runtime.pool.merging import MergePolicy, PoolStats
from rootstock.runtime.pool.relay import (
    BATCH,
    DEADLINE,
    RELAY_VERSION,
    RawFrame,
    ReplyBound,
    batch_problem,
    check_init,
    deadline_seconds,
    error_payload,
    forceready_model,
    posdata_natoms,
    read_client_frame,
    read_worker_reply,
)
from rootstock.runtime.server import owner_record, peer_uid
from rootstock.runtime.session import WorkerSession
from rootstock.runtime.spec import WorkerSpec
from rootstock.runtime.worker_keys import worker_key
from rootstock.wire.framing import (
    ERROR,
    EXIT,
    FORCEREADY,
    GETFORCE,
    INIT,
    NEEDINIT,
    POSDATA,
    READY,
    RSMERGE,
    STATUS,
    FrameStream,
    FrameTimeout,
    PeerClosed,
    encode_error,
    encode_posdata,
)

log = logging.getLogger("rootstock.pool")

DEFAULT_IDLE_TIMEOUT = 600.0
# How often the daemon re-computes its worker key to notice a rebuild or hotfix.
STALE_CHECK_S = 2.0
TICK_S = 0.2
# How long a stop waits for a call in flight before the worker is killed.
STOP_GRACE_S = 5.0
# How long shutdown waits for clients in a call to receive the failure that ended it.
ANSWER_GRACE_S = 5.0
EXIT_SETUP_FAILED = 3
# The first line each daemon writes to the key's log: a client reading the log's
# tail for a failure starts there, so earlier daemons' lines never show up.
START_MARK = "pool daemon starting"


@dataclass(frozen=True)
class Failure:
    """Why the daemon gave up its worker, as the ERROR its waiting clients get."""

    type: str
    message: str
    details: dict[str, Any]

    def frame(self) -> bytes:
        return encode_error(self.type, self.message, "", "pool", **self.details)


class PoolClient:
    """One connected client: its stream and the system it last described (INIT)."""

    def __init__(self, ident: int, conn: socket.socket) -> None:
        self.ident = ident
        self.conn = conn
        self.stream = FrameStream(conn, peer=f"pool client {ident}")
        self.init: bytes | None = None
        self.init_pending = False  # an INIT the worker has not seen yet
        self.init_merges = False  # its system's calls may be merged with others' (no extras)
        self.refused_init: str | None = None  # why the last INIT was not accepted
        self.posdata: bytes | None = None
        self.timeout: float | None = None  # the caller's, from its RSDEADLINE

    def hang_up(self) -> None:
        """Wake this client's reader thread and close the connection."""
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)


@dataclass(eq=False)
class Request:
    """One client's request waiting for, or at, the worker.

    ``call`` holds a single call's INIT and POSDATA frames (merged with others' when
    ``mergeable``); ``body`` a client's whole BATCH frame, which always goes alone.
    """

    client: PoolClient
    deadline: float | None
    bound: ReplyBound
    natoms: int
    payload: tuple[bytes, bytes] | bytes
    arrived: float = field(default_factory=time.monotonic)
    taken: float | None = None
    reply: bytes | None = None
    raised: BaseException | None = None

    @property
    def call(self) -> tuple[bytes, bytes] | None:
        return self.payload if isinstance(self.payload, tuple) else None

    @property
    def body(self) -> bytes | None:
        return self.payload if isinstance(self.payload, bytes) else None

    @property
    def mergeable(self) -> bool:
        return self.call is not None and self.client.init_merges


class PoolDaemon:
    """The daemon for one worker key (see the module docstring)."""

    def __init__(
        self,
        spec: WorkerSpec,
        files: PoolFiles,
        *,
        idle_timeout: float,
        startup_timeout: float | None,
    ) -> None:
        self.spec = spec
        self.files = files
        self.idle_timeout = idle_timeout
        self.startup_timeout = startup_timeout
        self.worker: WorkerSession | None = None
        self.worker_lock = threading.Lock()
        self._clients_lock = threading.Lock()
        self.clients: dict[int, PoolClient] = {}
        self._next_ident = 1
        # The client whose INIT the worker holds; read and written under worker_lock.
        self._system_of: int | None = None
        self._listener: socket.socket | None = None
        self._socket_unlinked = False
        self._retire = threading.Event()  # set by any thread; the main loop closes the listener
        self.stale = False
        self.stop_requested = threading.Event()
        self.worker_failed = threading.Event()
        self.failure: Failure | None = None  # set before worker_failed, under worker_lock
        self._in_call = 0  # clients between a request and its answer (under _clients_lock)
        self.started = utc_now()
        # The requests waiting for the worker, in arrival order, and whether a client
        # thread is at the worker with a batch of them (both under _turn).
        self.policy = MergePolicy.from_environment()
        self._turn = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._leading = False
        # Whether the worker takes RSMERGE: None until its first model report says.
        self.worker_merges: bool | None = None
        self.stats = PoolStats()
        self._stats_written = -1

    # --- start-up -------------------------------------------------------------------

    def start_worker(self) -> bytes | None:
        """Spawn the worker and check setup(); the ERROR payload if setup() failed."""
        session = WorkerSession(self.spec, timeout=self.startup_timeout)
        session.start()
        # The clients record their own sessions; the daemon's would double-count.
        session.usage.connected = False
        self.worker = session
        stream = session.stream
        if stream is None:
            raise ProtocolError("the worker session has no connection")
        stream.set_deadline(self.startup_timeout or None, session._check_alive)
        stream.send(STATUS)
        answer = stream.read_bytes(len(READY))
        if answer == READY:
            return None
        if answer != NEEDINIT:
            raise ProtocolError(f"the worker answered STATUS with {answer!r}")
        # A worker whose setup() failed reports the failure at the first GETFORCE.
        probe = encode_posdata(np.eye(3) * 10.0, np.zeros((1, 3)))
        stream.send(probe + GETFORCE)
        reply = read_worker_reply(stream, ReplyBound(natoms=1))
        if reply.header != ERROR:
            raise ProtocolError("the worker said NEEDINIT but then computed a result")
        return error_payload(reply)

    def bind(self) -> None:
        """Listen on the key's socket, which only this user can open (0600)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        previous = os.umask(0o177)
        try:
            sock.bind(str(self.files.socket))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(previous)
        os.chmod(self.files.socket, 0o600)
        sock.listen(64)
        sock.settimeout(TICK_S)
        self._listener = sock

    def state(self) -> dict[str, Any]:
        """What ``rootstock workers list`` reads for this daemon."""
        spec = self.spec
        worker = self.worker
        return {
            "schema": STATE_SCHEMA,
            "id": self.files.digest,
            "checkpoint": spec.checkpoint,
            "env": spec.env_name,
            "device": spec.device,
            "root": str(spec.layout.root),
            "setup_kwargs": spec.setup_kwargs,
            "daemon": owner_record(),
            "worker_pid": worker.pid if worker is not None else None,
            "clients": len(self.clients),
            "started": self.started,
            "idle_timeout": self.idle_timeout,
            "stale": self.stale,
            "socket": str(self.files.socket),
            "log": str(self.files.log),
            "relay": RELAY_VERSION,
            "merging": {
                "enabled": self.policy.enabled,
                "worker": self.worker_merges,
                "max_wait_ms": self.policy.max_wait_s * 1000.0,
            },
            "stats": self.stats.summary(),
        }

    def write_state(self) -> None:
        """Publish the state file (written aside and renamed)."""
        with contextlib.suppress(OSError):
            write_json_atomic(self.files.state, self.state())

    # --- the main loop --------------------------------------------------------------

    def serve(self) -> None:
        """Accept clients until it is time to go (see the module docstring)."""
        listener = self._listener
        idle_since = time.monotonic()
        next_check = time.monotonic() + STALE_CHECK_S
        while not self.stop_requested.is_set() and not self.worker_failed.is_set():
            worker = self.worker
            if worker is not None and worker.process is not None and worker.process.has_exited():
                log.warning("the worker exited on its own; closing every client")
                self.worker_failed.set()
                break
            if self._retire.is_set() and self._listener is not None:
                self.retire_socket()
                listener = None
            if listener is not None:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    pass
                except OSError as exc:
                    log.warning("the listening socket failed (%s); taking no new clients", exc)
                    self.retire_socket()
                    listener = None
                else:
                    self._admit(conn)
            else:
                time.sleep(TICK_S)
            now = time.monotonic()
            if self.clients:
                idle_since = now
            elif self.stale:
                log.info("stale and without clients: exiting")
                return
            elif now - idle_since >= self.idle_timeout:
                log.info("no client for %.0f s: exiting", self.idle_timeout)
                return
            if now >= next_check:
                next_check = now + STALE_CHECK_S
                self._check_stale()
                listener = self._listener
                # /tmp cleaners judge a directory by its age; ours is in use.
                with contextlib.suppress(OSError):
                    os.utime(self.files.directory)
                if self.stats.version != self._stats_written:
                    self._stats_written = self.stats.version
                    self.write_state()

    def _check_stale(self) -> None:
        if self.stale:
            return
        try:
            current = worker_key(self.spec).digest
        except RootstockError:
            current = None
        if current == self.files.digest:
            return
        log.info(
            "the env changed (key %s -> %s): taking no new clients", self.files.digest, current
        )
        self.stale = True
        self.retire_socket()
        self.write_state()

    def retire_socket(self) -> None:
        """Take no new clients: unlink the socket, so the next attach starts afresh.

        Only the main thread closes the listener (it may be inside ``accept``);
        another thread calls :meth:`request_retire`.
        """
        self._unlink_socket()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def request_retire(self) -> None:
        """From a client thread: unlink the socket now; the main loop closes the listener."""
        self._unlink_socket()
        self._retire.set()

    def _unlink_socket(self) -> None:
        # Once only: after a retire, the next daemon of this key may bind the same path.
        with self._clients_lock:
            if self._socket_unlinked:
                return
            self._socket_unlinked = True
        with contextlib.suppress(FileNotFoundError):
            self.files.socket.unlink()

    def _admit(self, conn: socket.socket) -> None:
        uid = peer_uid(conn)
        if uid is not None and uid != os.getuid():
            log.warning("refused a connection from uid %d", uid)
            conn.close()
            return
        with self._clients_lock:
            client = PoolClient(self._next_ident, conn)
            self._next_ident += 1
            self.clients[client.ident] = client
        self.write_state()
        threading.Thread(
            target=self._serve_client, args=(client,), name=f"client-{client.ident}", daemon=True
        ).start()

    # --- one client -----------------------------------------------------------------

    def _serve_client(self, client: PoolClient) -> None:
        try:
            self._relay(client)
        except (ProtocolError, OSError) as exc:
            log.debug("client %d left: %s", client.ident, exc)
        finally:
            # Idents are never reused, so a departed client's ident left in _system_of
            # matches nobody: the next caller re-sends its INIT.
            with self._clients_lock:
                self.clients.pop(client.ident, None)
            client.stream.close()
            if not self.worker_failed.is_set():
                self.write_state()

    def _relay(self, client: PoolClient) -> None:
        stream = client.stream
        while True:
            stream.set_deadline(None, self._check_running)
            frame = read_client_frame(stream)
            if frame.header == INIT:
                check = check_init(frame)
                if check.problem is None:
                    client.init, client.init_pending = frame.data, True
                    client.init_merges = check.mergeable
                client.refused_init = check.problem
            elif frame.header == POSDATA:
                client.posdata = frame.data
            elif frame.header == DEADLINE:
                client.timeout = deadline_seconds(frame)
            elif frame.header == STATUS:
                stream.send(READY)
            elif frame.header == EXIT:
                return
            elif frame.header == GETFORCE:
                self._request(client, self._getforce)
            elif frame.header == BATCH:
                self._request(client, functools.partial(self._batch, frame=frame))

    def _check_running(self) -> None:
        if self.stop_requested.is_set() or self.worker_failed.is_set():
            raise PeerClosed("the pool daemon is stopping")

    def _request(self, client: PoolClient, call: Any) -> None:
        """Answer one request; the deadline counts from its arrival (the caller's clock).

        ``call(client, deadline)`` gives the answer at once (a refusal) or a
        :class:`Request` that waits its turn at the worker (:meth:`_submit`).
        """
        deadline = None if client.timeout is None else time.monotonic() + client.timeout
        with self._clients_lock:
            self._in_call += 1
        try:
            made = call(client, deadline)
            self._answer(client, made if isinstance(made, bytes) else self._submit(made))
        finally:
            with self._clients_lock:
                self._in_call -= 1

    def _getforce(self, client: PoolClient, deadline: float | None) -> bytes | Request:
        refused, client.refused_init = client.refused_init, None
        if refused is not None:
            client.posdata = None
            return encode_error(
                "ProtocolError", f"the pool refused this INIT: {refused}", "", "init"
            )
        if client.posdata is None or client.init is None:
            # Forwarding this would put the worker out of step for every client.
            return encode_error(
                "ProtocolError",
                "GETFORCE without a system (INIT) and positions (POSDATA) first",
                "",
                "calculate",
            )
        init, posdata = client.init, client.posdata
        client.posdata = None
        natoms = posdata_natoms(posdata)
        return Request(client, deadline, ReplyBound(natoms=natoms), natoms, (init, posdata))

    def _batch(
        self, client: PoolClient, deadline: float | None, *, frame: RawFrame
    ) -> bytes | Request:
        problem, bound = batch_problem(frame)
        if problem is not None:
            return encode_error(
                "ProtocolError", f"the pool refused this BATCH: {problem}", "", "calculate"
            )
        return Request(client, deadline, bound, bound.atoms, frame.data)

    # --- turns at the worker ----------------------------------------------------------

    def _submit(self, request: Request) -> bytes:
        """Queue ``request`` and wait for its answer, taking a turn at the worker with
        whatever heads the queue whenever nobody else is at it (module
        :mod:`rootstock.runtime.pool.merging` says what a turn takes)."""
        with self._turn:
            self._queue.append(request)
            self._turn.notify_all()  # a turn that is gathering company may take it
        while True:
            with self._turn:
                answer = self._await_turn(request)
                if answer is not None:
                    return answer
                turn = self._take_turn()
            try:
                if turn:
                    self._run_turn(turn)
            except Exception:
                if request in turn:
                    raise
                # Each request of that turn holds the error for its own client; this
                # one's is still queued, and the loop above answers it.
            finally:
                with self._turn:
                    self._leading = False
                    self._turn.notify_all()

    def _await_turn(self, request: Request) -> bytes | None:
        """Under ``_turn``: the answer once it is there, or None when this thread is to
        take the next turn. A request still queued when its deadline passes leaves the
        queue unsent; one already at the worker waits for its turn to end (the turn's
        own deadline is the earliest of its requests')."""
        while True:
            if request.raised is not None:
                raise request.raised
            if request.reply is not None:
                return request.reply
            if not self._leading and self._queue:
                self._leading = True
                return None
            wait = TICK_S * 5
            if request.taken is None:
                # Still queued: a failure or a stop answers it without the worker.
                if self.failure is not None:
                    self._queue.remove(request)
                    return self.failure.frame()
                self._check_running()
                if request.deadline is not None:
                    left = request.deadline - time.monotonic()
                    if left <= 0:
                        self._queue.remove(request)
                        return self._busy(request.client)
                    wait = min(wait, left)
            self._turn.wait(wait)

    def _take_turn(self) -> list[Request]:
        """Under ``_turn``: the requests of the next turn, once any gathering is over."""
        gather = self.policy.gathering(self._queue, self.worker_merges, len(self.clients))
        if gather > 0:
            until = self._queue[0].arrived + gather
            while self.policy.gathering(self._queue, self.worker_merges, len(self.clients)) > 0:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._turn.wait(left)
        if not self._queue:  # what it gathered for left the queue at its deadline
            return []
        turn = self.policy.take(self._queue, self.worker_merges)
        now = time.monotonic()
        for request in turn:
            request.taken = now
        return turn

    def _run_turn(self, turn: list[Request]) -> None:
        """Send the turn to the worker and hand each request its answer."""
        waits = [request.taken - request.arrived for request in turn if request.taken]
        singles = sum(1 for request in turn if request.call is not None)
        try:
            replies = [self._one(turn[0])] if len(turn) == 1 else self._merged(turn)
        except BaseException as exc:
            for request in turn:
                request.raised = exc
            raise
        finally:
            self.stats.record_turn(waits, singles)
        for request, reply in zip(turn, replies, strict=True):
            request.reply = reply

    def _one(self, request: Request) -> bytes:
        """One call or one client BATCH, alone, as before merging existed."""
        client = request.client
        if request.call is None:
            assert isinstance(request.body, bytes)
            body = request.body
            return self._call_worker(client, lambda: [body], [request.bound], request.deadline)[0]
        init, posdata = request.call

        def parts() -> list[bytes]:
            # Runs under the worker lock: only there is the worker's system known.
            return [*self._init_if_needed(client, init), posdata, GETFORCE]

        reply = self._call_worker(client, parts, [request.bound], request.deadline)[0]
        if self.worker_merges is None and reply.startswith(FORCEREADY):
            model = forceready_model(RawFrame(FORCEREADY, reply))
            if model is not None:
                self.worker_merges = model.get("merge") is True
                log.info("the worker %s merged calls", "takes" if self.worker_merges else "refuses")
        return reply

    def _merged(self, turn: list[Request]) -> list[bytes]:
        """Several clients' single calls as one ``RSMERGE``; one reply each, in order.
        The turn's deadline is the earliest of its requests', and a timeout message
        names that caller's timeout."""
        first = min(turn, key=lambda r: math.inf if r.deadline is None else r.deadline)

        def parts() -> list[bytes]:
            out = [RSMERGE, struct.pack("=i", len(turn))]
            for request in turn:
                assert request.call is not None  # only single calls are merged
                init, posdata = request.call
                out.extend((*self._init_if_needed(request.client, init), posdata, GETFORCE))
            return out

        bounds = [request.bound for request in turn]
        return self._call_worker(first.client, parts, bounds, first.deadline)

    def _init_if_needed(self, client: PoolClient, init: bytes) -> list[bytes]:
        """Under the worker lock: the client's INIT when the worker holds another
        system (or a newer INIT of its own is pending), and now the worker holds its."""
        out = [init] if self._system_of != client.ident or client.init_pending else []
        client.init_pending = False
        self._system_of = client.ident
        return out

    def _busy(self, client: PoolClient) -> bytes:
        return encode_error(
            "WorkerTimeout",
            f"the pooled worker for {self.spec.checkpoint!r} was busy with other "
            f"clients' calls for the whole {client.timeout:g} s timeout; it is still "
            "running, and this call was not sent to it",
            "",
            "queue",
        )

    def _call_worker(
        self,
        client: PoolClient,
        parts: Any,
        bounds: list[ReplyBound],
        deadline: float | None,
    ) -> list[bytes]:
        """Send ``parts()`` to the worker and read its replies, one per bound, under the
        worker lock.

        ``parts`` is called with the lock held. The caller's ``deadline`` covers the
        wait for the lock (the worker is then left alone) and the replies (the worker
        is then stopped: it may be stuck, and every later caller would wait on it).
        A failure answers every request of the turn with the same ``ERROR``.
        """
        count = len(bounds)
        wait = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self.worker_lock.acquire(timeout=wait):
            return [self._busy(client)] * count
        try:
            if self.failure is not None:
                return [self.failure.frame()] * count
            worker = self.worker
            stream = worker.stream if worker is not None else None
            if stream is None or self.worker_failed.is_set():
                raise PeerClosed("the worker is gone")
            try:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
                stream.set_deadline(remaining, self._check_worker)
                stream.send(b"".join(parts()))
                replies = [read_worker_reply(stream, bound) for bound in bounds]
            except FrameTimeout:
                return [
                    self._fail(
                        client,
                        "WorkerTimeout",
                        f"the pooled worker for {self.spec.checkpoint!r} "
                        f"(pid {self._worker_pid()}) did not answer within the caller's "
                        f"{client.timeout:g} s timeout; the pool daemon stopped it, and the "
                        "next call starts a fresh one",
                    )
                ] * count
            except (WorkerDiedError, PeerClosed, ConnectionError) as exc:
                died = exc if isinstance(exc, WorkerDiedError) else self._died()
                text = died.message.removeprefix("the worker for ")
                return [
                    self._fail(
                        client,
                        "WorkerDiedError",
                        f"the pooled worker for {text}; the next call attaches to a fresh one",
                        exit_code=died.worker_exit_code,
                        output_tail=died.output_tail,
                    )
                ] * count
            except (ProtocolError, OSError) as exc:
                return [
                    self._fail(
                        client,
                        "ProtocolError",
                        f"the pooled worker for {self.spec.checkpoint!r} "
                        f"(pid {self._worker_pid()}) sent a malformed reply ({exc}); the pool "
                        "daemon stopped it, and the next call starts a fresh one",
                    )
                ] * count
        finally:
            self.worker_lock.release()
        if any(reply.header == ERROR and _setup_phase(reply) for reply in replies):
            self.worker_failed.set()
        return [reply.data for reply in replies]

    def _died(self) -> WorkerDiedError:
        """The worker closed its connection: its own exit status and output."""
        worker = self.worker
        if worker is None:
            return WorkerDiedError("the pooled worker is gone", worker_exit_code=None)
        return worker._died("during a calculation")

    def _worker_pid(self) -> int | None:
        return self.worker.pid if self.worker is not None else None

    def _fail(self, client: PoolClient, type_: str, message: str, **details: Any) -> bytes:
        """Give up the worker (the caller holds worker_lock): stop it, take no new
        clients, and tell this caller and every waiting one why."""
        log.warning("client %d's call: %s", client.ident, message)
        self.failure = Failure(type_, message, details)
        self.worker_failed.set()
        self.request_retire()
        worker = self.worker
        if worker is not None:
            worker.close(graceful=False)
        return self.failure.frame()

    def _check_worker(self) -> None:
        worker = self.worker
        if worker is not None and worker.process is not None and worker.process.has_exited():
            raise worker._died("during a calculation")

    def _answer(self, client: PoolClient, reply: bytes) -> None:
        # A client that died mid-call only loses its own reply: the worker's was read whole.
        client.stream.set_deadline(30.0)
        client.stream.send(reply)

    # --- shutting down --------------------------------------------------------------

    def shutdown(self) -> None:
        """Close every client, stop the worker, remove this daemon's files.

        Clients in a call are given a moment to receive the failure that ended
        the daemon, so they learn why instead of seeing the connection close.
        """
        self.retire_socket()
        until = time.monotonic() + ANSWER_GRACE_S
        while self.failure is not None and self._in_call and time.monotonic() < until:
            time.sleep(0.02)
        with self._clients_lock:
            clients = list(self.clients.values())
        for client in clients:
            client.hang_up()
        worker = self.worker
        if worker is not None:
            got = self.worker_lock.acquire(
                timeout=0 if self.worker_failed.is_set() else STOP_GRACE_S
            )
            try:
                worker.close(graceful=got and not self.worker_failed.is_set())
            finally:
                if got:
                    self.worker_lock.release()
        self._remove_own(self.files.state)

    def _remove_own(self, path: Path) -> None:
        # A newer daemon for the same key may have written it since our socket went.
        state = read_json(path)
        daemon = state.get("daemon") if state else None
        if isinstance(daemon, dict) and daemon.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _setup_phase(reply: RawFrame) -> bool:
    try:
        return json.loads(error_payload(reply)).get("phase") == "setup"
    except (ValueError, AttributeError):
        return False


def start_failure_record(exc: WorkerError) -> dict[str, Any]:
    """The error file's content for a worker that never got ready (read by the client)."""
    record: dict[str, Any] = {
        "type": type(exc).__name__,
        "message": exc.message,
        "traceback": exc.remote_traceback,
        "phase": "setup",
    }
    if isinstance(exc, WorkerDiedError):
        record["exit_code"] = exc.worker_exit_code
        record["output_tail"] = exc.output_tail
    if exc.hint:
        record["hint"] = exc.hint
    return record


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rootstock.runtime.pool.daemon")
    parser.add_argument("--spec", required=True, help="the worker spec as JSON")
    parser.add_argument("--digest", required=True, help="the worker key digest")
    parser.add_argument("--pool-dir", required=True, help="the private pool directory")
    parser.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT)
    parser.add_argument("--startup-timeout", type=float, default=0.0, help="0: no limit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one pool daemon; the exit code says how it ended."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s pool %(process)d %(levelname)s %(message)s"
    )
    directory = Path(args.pool_dir)
    check_private_dir(directory)
    files = PoolFiles(directory, args.digest)
    spec = WorkerSpec.from_json(args.spec)
    if worker_key(spec).digest != args.digest:
        log.error("the env changed before the daemon started; the next attach retries")
        return 1
    daemon = PoolDaemon(
        spec,
        files,
        idle_timeout=args.idle_timeout,
        startup_timeout=args.startup_timeout or None,
    )
    serving = False

    def on_signal(signum: int, _frame: Any) -> None:
        if not serving:
            raise SystemExit(128 + signum)  # aborts start-up; the session kills the worker
        daemon.stop_requested.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    log.info("%s (pid %d) for %s", START_MARK, os.getpid(), spec.checkpoint)
    try:
        try:
            failure = daemon.start_worker()
        except WorkerError as exc:
            # Died or timed out while loading the model: the client that started us
            # reports the worker's own exit status and output, as without the pool.
            log.error("the worker did not start: %s", exc.message)
            write_json_atomic(files.error, start_failure_record(exc))
            return EXIT_SETUP_FAILED
        if failure is not None:
            log.error("the worker's setup() failed; reporting it and exiting")
            write_json_atomic(files.error, json.loads(failure))
            return EXIT_SETUP_FAILED
        daemon.bind()
        daemon.write_state()
        serving = True
        log.info(
            "serving %s (worker pid %s) on %s",
            spec.checkpoint,
            daemon.worker and daemon.worker.pid,
            files.socket,
        )
        daemon.serve()
    finally:
        daemon.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
