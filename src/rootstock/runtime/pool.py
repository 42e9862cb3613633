"""The pool daemon: one warm worker shared by the user's processes on a node.

``python -m rootstock.runtime.pool --spec JSON --digest D ...`` is started by
:func:`rootstock.runtime.pool_client.ensure_daemon`, detached (its own session,
stdin /dev/null, output to ``<digest>.log`` in the pool directory). It spawns the
worker as any session does (the worker never binds, and holds the daemon's
lifeline, so a killed daemon takes its worker along), checks that ``setup()``
worked, then binds ``<digest>.sock`` (0600) and relays.

Each client speaks the worker protocol. The daemon keeps every client's last
``INIT``, and under one worker lock sends it ahead of that client's
``POSDATA``+``GETFORCE`` when the worker's current system is someone else's; the
reply goes back byte for byte. ``BATCH`` frames go through whole and leave the
worker's system as it was. ``STATUS`` is answered here (``READY``) and ``EXIT``
means that client leaves.

The daemon exits when its idle timeout passes with no client, when it is told to
stop (SIGTERM), when the worker dies (every client then sees its connection
close), or, once its env was rebuilt or hotfixed (the worker key changed), as soon
as its last client has gone; from the moment it knows it is stale it takes no new
client (its socket is unlinked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from rootstock.errors import ProtocolError, RootstockError
from rootstock.runtime.pool_dir import (
    STATE_SCHEMA,
    PoolFiles,
    check_private_dir,
    read_json,
    utc_now,
    write_json_atomic,
)
from rootstock.runtime.pool_relay import (
    BATCH,
    RawFrame,
    error_payload,
    read_client_frame,
    read_worker_reply,
)
from rootstock.runtime.protocol import (
    ERROR,
    EXIT,
    GETFORCE,
    INIT,
    NEEDINIT,
    POSDATA,
    READY,
    STATUS,
    FrameStream,
    PeerClosed,
    encode_error,
    encode_posdata,
)
from rootstock.runtime.server import owner_record, peer_uid
from rootstock.runtime.session import WorkerSession
from rootstock.runtime.spec import WorkerSpec
from rootstock.runtime.worker_key import worker_key

log = logging.getLogger("rootstock.pool")

DEFAULT_IDLE_TIMEOUT = 600.0
# How often the daemon re-computes its worker key to notice a rebuild or hotfix.
STALE_CHECK_S = 2.0
TICK_S = 0.2
# How long a stop waits for a call in flight before the worker is killed.
STOP_GRACE_S = 5.0
EXIT_SETUP_FAILED = 3


class PoolClient:
    """One connected client: its stream and the system it last described (INIT)."""

    def __init__(self, ident: int, conn: socket.socket) -> None:
        self.ident = ident
        self.conn = conn
        self.stream = FrameStream(conn, peer=f"pool client {ident}")
        self.init: bytes | None = None
        self.init_pending = False  # an INIT the worker has not seen yet
        self.posdata: bytes | None = None

    def hang_up(self) -> None:
        """Wake this client's reader thread and close the connection."""
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)


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
        self._system_of: int | None = None  # the client whose INIT the worker holds
        self._listener: socket.socket | None = None
        self._socket_unlinked = False
        self.stale = False
        self.stop_requested = threading.Event()
        self.worker_failed = threading.Event()
        self.started = utc_now()

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
        reply = read_worker_reply(stream)
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
            if listener is not None:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    pass
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
        """Take no new clients: unlink the socket, so the next attach starts afresh."""
        if not self._socket_unlinked:
            self._socket_unlinked = True
            with contextlib.suppress(FileNotFoundError):
                self.files.socket.unlink()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

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
            with self._clients_lock:
                self.clients.pop(client.ident, None)
            if self._system_of == client.ident:
                self._system_of = None
            client.stream.close()
            if not self.worker_failed.is_set():
                self.write_state()

    def _relay(self, client: PoolClient) -> None:
        stream = client.stream
        while True:
            stream.set_deadline(None, self._check_running)
            frame = read_client_frame(stream)
            if frame.header == INIT:
                client.init, client.init_pending = frame.data, True
            elif frame.header == POSDATA:
                client.posdata = frame.data
            elif frame.header == STATUS:
                stream.send(READY)
            elif frame.header == EXIT:
                return
            elif frame.header == GETFORCE:
                self._answer(client, self._getforce(client))
            elif frame.header == BATCH:
                self._answer(client, self._call_worker(client, [frame.data], None))

    def _check_running(self) -> None:
        if self.stop_requested.is_set() or self.worker_failed.is_set():
            raise PeerClosed("the pool daemon is stopping")

    def _getforce(self, client: PoolClient) -> bytes:
        if client.posdata is None or client.init is None:
            # Forwarding this would put the worker out of step for every client.
            return encode_error(
                "ProtocolError",
                "GETFORCE without a system (INIT) and positions (POSDATA) first",
                "",
                "calculate",
            )
        parts = []
        if self._system_of != client.ident or client.init_pending:
            parts.append(client.init)
        parts += [client.posdata, GETFORCE]
        client.posdata, client.init_pending = None, False
        return self._call_worker(client, parts, client.ident)

    def _call_worker(self, client: PoolClient, parts: list[bytes], system: int | None) -> bytes:
        """Send ``parts`` to the worker and read its whole reply, under the worker lock."""
        with self.worker_lock:
            worker = self.worker
            stream = worker.stream if worker is not None else None
            if stream is None or self.worker_failed.is_set():
                raise PeerClosed("the worker is gone")
            try:
                stream.set_deadline(None, self._check_worker)
                stream.send(b"".join(parts))
                if system is not None:
                    self._system_of = system
                reply = read_worker_reply(stream)
            except (ProtocolError, OSError) as exc:
                log.warning("the worker failed during client %d's call: %s", client.ident, exc)
                self.worker_failed.set()
                self.retire_socket()
                raise PeerClosed("the worker is gone") from None
        if reply.header == ERROR and _setup_phase(reply):
            self.worker_failed.set()
        return reply.data

    def _check_worker(self) -> None:
        worker = self.worker
        if worker is not None and worker.process is not None and worker.process.has_exited():
            raise PeerClosed("the worker exited")

    def _answer(self, client: PoolClient, reply: bytes) -> None:
        # A client that died mid-call only loses its own reply: the worker's was read whole.
        client.stream.set_deadline(30.0)
        client.stream.send(reply)

    # --- shutting down --------------------------------------------------------------

    def shutdown(self) -> None:
        """Close every client, stop the worker, remove this daemon's files."""
        self.retire_socket()
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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rootstock.runtime.pool")
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
    try:
        failure = daemon.start_worker()
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
