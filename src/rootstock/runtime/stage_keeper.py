"""The keeper of one squashfuse mount of a stage: ``python -m rootstock.runtime.stage_keeper``.

Started by the first worker's staging (:mod:`rootstock.runtime.stage`) in a session
of its own, it runs ``squashfuse -f IMAGE MOUNT`` as its child and watches the
entry's ``users.lock``: once nobody has held it for the idle timeout, it unmounts
(a busy mount is never detached; it tries again later) and exits. The child gets
SIGTERM when the keeper dies, however it dies (``PR_SET_PDEATHSIG``), and
squashfuse unmounts on SIGTERM, so a killed keeper leaves no mount behind. A
server that died leaves a dead mount, which is detached.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rootstock.runtime.pool.directory import write_json_atomic
from rootstock.runtime.stage_dir import (
    IMAGE_FILE,
    KEEPER_FILE,
    MOUNT_DIR,
    claim_unused,
    detach,
    unmount,
)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def keep(entry: Path, idle_s: float) -> int:
    """Mount ``entry``'s image and keep it while it is used; the exit code."""
    mount = entry / MOUNT_DIR
    child = subprocess.Popen(
        ["squashfuse", "-f", str(entry / IMAGE_FILE), str(mount)],
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,  # the one way to set a death signal
    )
    record = entry / KEEPER_FILE
    write_json_atomic(record, {"pid": os.getpid(), "squashfuse": child.pid})

    def stop(_signum: int, _frame: object) -> None:
        child.terminate()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    poll = min(1.0, max(idle_s / 4, 0.05))
    idle_since: float | None = None
    try:
        while child.poll() is None:
            with claim_unused(entry) as unused:
                if not unused:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= idle_s and unmount(mount):
                    child.wait(timeout=60)
                    break
            time.sleep(poll)
    finally:
        if child.poll() is None:
            child.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=30)
        detach(mount)
        with contextlib.suppress(OSError):
            record.unlink()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m rootstock.runtime.stage_keeper ENTRY IDLE_S", file=sys.stderr)
        return 2
    return keep(Path(argv[1]), float(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
