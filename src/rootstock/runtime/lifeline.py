"""A lifeline: an inherited pipe whose end-of-file tells a child its starter is gone.

The starting process keeps the write end and hands the read end to the child
(``pass_fds``). It never writes: the read end sees EOF only when every copy of the
write end is closed, which the kernel does when the starter exits, however it
exits (SIGKILL included). Unlike ``PR_SET_PDEATHSIG`` this follows the *process*,
not the thread that spawned the child, so children started from pool threads are
covered too, and unlike polling ``os.getppid()`` it cannot miss a parent that died
before the child first looked.

Stdlib only: the worker (inside every env) and the build supervisor both use it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

#: The command-line option that carries the read end's fd number to a child.
LIFELINE_OPTION = "--lifeline-fd"


class Lifeline:
    """The starter's side: a pipe whose read end a child inherits.

    Pass :attr:`child_fd` in ``pass_fds`` (and its number on the child's command
    line), call :meth:`child_started` once the child exists, and :meth:`close`
    when the child should be told to go (or just exit).
    """

    def __init__(self) -> None:
        # os.pipe() fds are close-on-exec, so no other child inherits them.
        self.child_fd, self._write_fd = os.pipe()

    def child_started(self) -> None:
        """Drop our copy of the read end: from now on only the child holds it."""
        if self.child_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.child_fd)
            self.child_fd = -1

    def close(self) -> None:
        """Close both ends; the child sees EOF now."""
        self.child_started()
        if self._write_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._write_fd)
            self._write_fd = -1

    def __del__(self) -> None:  # a dropped lifeline must not leak fds
        self.close()


def watch_lifeline(fd: int, on_lost: Callable[[], None]) -> threading.Thread:
    """Call ``on_lost`` (from a daemon thread) once ``fd`` reaches end-of-file.

    The fd is made non-inheritable first, so grandchildren (compilers, uv's own
    children) do not keep a dead starter's lifeline open. ``on_lost`` normally
    ends the process with ``os._exit``: that works even while the main thread is
    inside a long native call such as a model evaluation.
    """
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)

    def wait() -> None:
        while True:
            try:
                data = os.read(fd, 4096)
            except InterruptedError:
                continue
            except OSError:
                break
            if not data:
                break
        on_lost()

    thread = threading.Thread(target=wait, name="rootstock-lifeline", daemon=True)
    thread.start()
    return thread
