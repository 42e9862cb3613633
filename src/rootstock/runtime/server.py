"""The listening side of a worker connection: a Unix socket in a private directory.

The calculator binds, the worker connects. The socket lives in a fresh directory
made by :func:`tempfile.mkdtemp` (mode 0700) under ``$XDG_RUNTIME_DIR`` or the
system temp dir, so no other user can reach it and no fixed name in ``/tmp`` can be
squatted. The same directory holds the worker's captured output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rootstock.errors import ProtocolError, WorkerTimeout

log = logging.getLogger("rootstock.runtime")

SOCKET_NAME = "worker.sock"
# sun_path holds 108 bytes on Linux (104 on macOS); stay clear of both.
_MAX_SOCKET_PATH = 100
ACCEPT_SLICE_S = 0.1


def runtime_base_dir() -> Path:
    """Where private run directories go: ``$XDG_RUNTIME_DIR`` if usable, else the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg)
    return Path(tempfile.gettempdir())


def make_private_dir(prefix: str = "rootstock-") -> Path:
    """A fresh 0700 directory whose socket path fits in ``sun_path``."""
    base = runtime_base_dir()
    # mkdtemp adds 8 random characters; leave room for "/worker.sock".
    if len(os.fsencode(base)) + len(prefix) + 9 + 1 + len(SOCKET_NAME) > _MAX_SOCKET_PATH:
        # HPC job temp dirs can be long; /tmp itself is short and mkdtemp is still private.
        base = Path("/tmp")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


class WorkerListener:
    """A listening Unix socket for exactly one worker connection."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir or make_private_dir()
        self.path = self.run_dir / SOCKET_NAME
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(str(self.path))
            self._sock.listen(1)
        except OSError:
            self.cleanup()
            raise

    def accept(
        self, timeout: float | None, on_wait: Callable[[], None] | None = None
    ) -> socket.socket:
        """Wait for the worker to connect, calling ``on_wait`` (a liveness check) often.

        The listener is closed afterwards: one worker per listener.
        """
        if self._sock is None:
            raise ProtocolError("the worker listener is already closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._sock.settimeout(ACCEPT_SLICE_S)
        while True:
            try:
                conn, _ = self._sock.accept()
                break
            except TimeoutError:
                if on_wait is not None:
                    on_wait()
                if deadline is not None and time.monotonic() >= deadline:
                    raise WorkerTimeout(
                        f"the worker did not connect within {timeout:g} s",
                        hint="raise timeout= if the env is on a slow filesystem",
                    ) from None
        self.close()
        _check_peer(conn)
        return conn

    def close(self) -> None:
        """Stop listening and remove the socket file (the directory stays)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def cleanup(self) -> None:
        """Close and remove the whole private directory."""
        self.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _check_peer(conn: socket.socket) -> None:
    """Refuse a connection from another user (defence in depth on top of 0700)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        conn.close()
        raise ProtocolError(f"refused a worker connection from uid {uid}")
