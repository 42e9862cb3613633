"""``smoke-test --push-every N``: manifest snapshots pushed from a background thread.

Verification must never wait on the network, so a snapshot is only *requested*
from a result callback; one thread sends them, one at a time. A snapshot is the
whole manifest, so requests made while a push is in flight collapse into one
(the newest state supersedes the rest), and closing drops a pending request:
the caller's final push carries everything anyway.

Closing after the run waits for a push in flight, bounded by the retry deadline the
caller's final push then shares, so a dashboard that drops packets costs about one
retry cap at the end, not two. Leaving on an exception (Ctrl-C, a crash) does not
wait at all: the thread is a daemon, and a half-sent snapshot harms nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rootstock.ops.http_client import Deadline
from rootstock.ops.push import PushReport

# How long past the deadline an in-flight push may still take: one attempt's grace
# (see http_client._bounded_attempt) and some slack for the thread to wind up.
_JOIN_GRACE_S = 1.0


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
        self._waited = False
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

    def close(self, deadline: Deadline | None = None) -> None:
        """Drop any pending request and wait for an in-flight push to end.

        The wait is bounded: a push ends within its retry cap, and ``join_timeout``
        guards against anything else. With ``deadline`` (the one the caller's final
        push will use) the wait also ends shortly after it: a push started before
        the deadline was made ends by then, since it had the same cap. Only the
        first call waits.
        """
        self.abandon()
        if self._waited:
            return
        self._waited = True
        wait = self._join_timeout
        if deadline is not None:
            wait = min(wait, deadline.remaining() + _JOIN_GRACE_S)
        self._thread.join(wait)

    def abandon(self) -> None:
        """Drop any pending request and stop taking new ones, without waiting."""
        with self._cond:
            self._closed = True
            self._wanted = False
            self._cond.notify()

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

    def __exit__(self, exc_type: object, *_rest: object) -> None:
        if exc_type is not None:
            # Ctrl-C or a crash: leave now; the daemon thread dies with the process.
            self.abandon()
        else:
            self.close()


def _failed_report(exc: Exception) -> PushReport:
    from rootstock.ops.push import ClusterPush

    report = PushReport("manifest", "")
    report.results.append(ClusterPush("?", ok=False, message=str(exc).splitlines()[0]))
    return report
