"""``smoke-test --push-every``'s background snapshot pusher.

The pushes here are plain functions (no network): what is under test is the thread's
bookkeeping, coalescing requests, and when closing waits and when it must not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from rootstock.ops.http_client import Deadline
from rootstock.ops.push import PushReport
from rootstock.ops.snapshot_push import SnapshotPusher

pytestmark = pytest.mark.timeout(60)


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_snapshot_requests_coalesce_while_a_push_is_in_flight():
    release = threading.Event()
    calls: list[int] = []

    def push() -> PushReport:
        calls.append(1)
        release.wait(10)
        return PushReport("manifest", "http://stand-in")

    pusher = SnapshotPusher(push)
    pusher.request()
    _wait_for(lambda: calls)
    for _ in range(5):
        pusher.request()  # returns at once although a push is blocked
    release.set()
    _wait_for(lambda: len(pusher.reports) >= 2)
    pusher.request()
    pusher.close()  # drops the pending request: the caller's final push covers it
    assert len(calls) in (2, 3)
    assert len(calls) == len(pusher.reports)
    pusher.request()  # after close: ignored
    assert len(calls) == len(pusher.reports)


@pytest.fixture
def stuck() -> Iterator[tuple[SnapshotPusher, list]]:
    """A pusher whose push never ends until teardown, with its join recorded, not run.

    A join that really ran would wait the hour-long ``join_timeout`` (the test's
    timeout would end it); recording it shows whether closing waits at all.
    """
    release = threading.Event()
    started = threading.Event()

    def push() -> PushReport:
        started.set()
        release.wait(30)
        return PushReport("manifest", "http://stand-in")

    pusher = SnapshotPusher(push, join_timeout=3600.0)
    thread = pusher._thread
    joins: list = []
    thread.join = lambda timeout=None: joins.append(timeout)  # type: ignore[method-assign]
    pusher.request()
    assert started.wait(10)
    yield pusher, joins
    release.set()
    threading.Thread.join(thread, 10)
    assert not thread.is_alive()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_leaving_on_an_exception_does_not_wait_for_a_push(stuck, interrupt):
    pusher, joins = stuck
    with pytest.raises(interrupt), pusher:
        raise interrupt("Ctrl-C during smoke-test --push-every")
    assert joins == []
    pusher.request()  # abandoned: takes no more requests
    assert pusher._wanted is False


def test_closing_waits_no_longer_than_the_shared_deadline(stuck):
    pusher, joins = stuck
    spent = Deadline(0.0, clock=lambda: 50.0)
    pusher.close(spent)
    # Only the grace for an attempt in flight, not the hour-long join_timeout.
    assert len(joins) == 1 and joins[0] <= 1.0
    with pusher:  # leaving normally after close() does not wait a second time
        pass
    assert len(joins) == 1


def test_closing_without_a_deadline_waits_up_to_join_timeout(stuck):
    pusher, joins = stuck
    with pusher:
        pass
    assert joins == [3600.0]
