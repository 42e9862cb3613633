"""A lifeline: an inherited pipe whose end-of-file tells a child its starter is gone.

The starting process keeps the write end and hands the read end to the child
(``pass_fds``). It never writes: the read end sees EOF only when every copy of the
write end is closed, which the kernel does when the starter exits, however it
exits (SIGKILL included). Unlike ``PR_SET_PDEATHSIG`` this follows the *process*,
not the thread that spawned the child, so children started from pool threads are
covered too, and unlike polling ``os.getppid()`` it cannot miss a parent that died
before the child first looked.

A forked copy of the starter (``os.fork`` without exec, multiprocessing's fork
start method) would keep the write end open, so every live :class:`Lifeline`
closes its fds in a forked child: only the starter itself keeps its children alive.

Run by path, this file is also a tiny runner for a script that should die with its
starter but knows nothing of lifelines (``rootstock benchmark``'s in-env probe,
which may run under an older rootstock than this one)::

    python -I lifeline.py --lifeline-fd N SCRIPT [ARG...]

Stdlib only: the worker (inside every env) and the build supervisor both use it.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import threading
import weakref
from collections.abc import Callable, Sequence

#: The command-line option that carries the read end's fd number to a child.
LIFELINE_OPTION = "--lifeline-fd"
#: How a worker learns its lifeline's fd. An environment variable, not an option,
#: so a worker inside an env built by an older rootstock (which would refuse an
#: unknown option) still starts; the worker removes it before anything else runs.
LIFELINE_ENV = "ROOTSTOCK_LIFELINE_FD"
#: The exit status of a worker (or a script run by :func:`run_script`) whose starter
#: is gone. Nobody is left to read it; it tells a process-accounting log why.
STARTER_GONE_EXIT = 4

# Every Lifeline not yet closed, so a forked child can drop its copies of the fds.
_OPEN: weakref.WeakSet[Lifeline] = weakref.WeakSet()


class Lifeline:
    """The starter's side: a pipe whose read end a child inherits.

    Pass :attr:`child_fd` in ``pass_fds`` (and its number on the child's command
    line), call :meth:`child_started` once the child exists, and :meth:`close`
    when the child should be told to go (or just exit).
    """

    def __init__(self) -> None:
        # os.pipe() fds are close-on-exec, so no other child inherits them.
        self.child_fd, self._write_fd = os.pipe()
        _OPEN.add(self)

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
        _OPEN.discard(self)

    def _forget_in_forked_child(self) -> None:
        for name in ("child_fd", "_write_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

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


def _close_all_in_forked_child() -> None:
    for lifeline in list(_OPEN):
        lifeline._forget_in_forked_child()
    _OPEN.clear()


os.register_at_fork(after_in_child=_close_all_in_forked_child)


def script_command(python: str, lifeline_fd: int, script: str, args: Sequence[str]) -> list[str]:
    """The argv that runs ``script`` (by path, under ``python -I``) tied to ``lifeline_fd``."""
    return [
        python,
        "-I",
        "-u",
        "-X",
        "faulthandler",
        os.path.abspath(__file__),
        LIFELINE_OPTION,
        str(lifeline_fd),
        script,
        *args,
    ]


def run_script(argv: Sequence[str]) -> int:
    """``--lifeline-fd N SCRIPT [ARG...]``: run SCRIPT as ``__main__`` until the fd's EOF."""
    if len(argv) < 3 or argv[0] != LIFELINE_OPTION or not argv[1].isdigit():
        print(f"usage: python -I lifeline.py {LIFELINE_OPTION} N SCRIPT [ARG...]", file=sys.stderr)
        return 2
    script = argv[2]

    def starter_gone() -> None:
        print(
            f"{os.path.basename(script)}: the process that started it is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(STARTER_GONE_EXIT)

    watch_lifeline(int(argv[1]), starter_gone)
    sys.argv = [script, *argv[3:]]
    # As under `python -I SCRIPT`, no script directory is put on sys.path: the
    # script imports from the env alone.
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(sys.argv[1:]))
