"""``smoke-test --push-every N``: manifest snapshots pushed from a background thread.

Verification must never wait on the network, so a snapshot is only *requested*
from a result callback; one thread sends them, one at a time. A snapshot is the
whole manifest, so requests made while a push is in flight collapse into one
(the newest state supersedes the rest), and closing drops a pending request:
the caller's final push carries everything anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rootstock.ops.push import PushReport


class SnapshotPusher:
    """Runs ``push()`` on one background thread whenever :meth:`request` was called."""

    def __init__(
        self,
        push: Callable[[], PushReport],
        on_report: Callable[[PushReport], None] = lambda _r: None,
        join_timeout: float = 60.0,
    ) -> None:
        self._push = push
        self._on_report = on_report
        self._join_timeout = join_timeout
        self._cond = threading.Condition()
        self._wanted = False
        self._closed = False
        self.reports: list[PushReport] = []
        # A daemon thread: Ctrl-C or a crash of the command must not wait on a push.
        self._thread = threading.Thread(target=self._run, name="rootstock-push", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Ask for a snapshot push; returns at once."""
        with self._cond:
            if not self._closed:
                self._wanted = True
                self._cond.notify()

    def close(self) -> None:
        """Drop any pending request and wait for an in-flight push to end.

        The wait is bounded: a push ends within its retry cap, and ``join_timeout``
        guards against anything else.
        """
        with self._cond:
            self._closed = True
            self._wanted = False
            self._cond.notify()
        self._thread.join(self._join_timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._wanted or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
                self._wanted = False
            try:
                report = self._push()
            except Exception as exc:  # a snapshot must never end the run
                report = _failed_report(exc)
            self.reports.append(report)
            self._on_report(report)

    def __enter__(self) -> SnapshotPusher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _failed_report(exc: Exception) -> PushReport:
    from rootstock.ops.push import ClusterPush

    report = PushReport("manifest", "")
    report.results.append(ClusterPush("?", ok=False, message=str(exc).splitlines()[0]))
    return report
