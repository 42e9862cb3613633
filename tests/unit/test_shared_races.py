"""State that threads of one process share, changed by many at once (issue 28, the audit).

A check-then-set outside a lock is caught in the act by making the check slow (a
lease whose ``released`` takes a moment to read), or by many rounds with a tiny switch
interval.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rootstock.runtime import shared
from rootstock.runtime.pool.directory import write_json_atomic
from tests.integration.pooling import wait_for

THREADS = 8


@pytest.fixture
def eager_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _started(
    work: Callable[[int], object], threads: int = 1
) -> tuple[list[threading.Thread], list[BaseException]]:
    """``work(i)`` on ``threads`` threads released together; the threads, and the list
    that collects what they raise."""
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        barrier.wait(timeout=30)
        try:
            work(index)
        except BaseException as exc:  # collected for the assertion
            errors.append(exc)

    started = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for thread in started:
        thread.start()
    return started, errors


def _joined(started: list[threading.Thread]) -> None:
    for thread in started:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a thread did not finish within 60 s"


def _at_once(work: Callable[[int], object], threads: int = THREADS) -> list[BaseException]:
    """Run ``work(i)`` on ``threads`` threads released together; the errors they raised."""
    started, errors = _started(work, threads)
    _joined(started)
    return errors


class SlowToCheck(shared.Lease):
    """A lease whose ``released`` flag takes 2 ms to read: the window between a check
    and its set, held open."""

    @property
    def released(self) -> bool:
        value = self._released
        time.sleep(0.002)
        return value

    @released.setter
    def released(self, value: bool) -> None:
        self._released = value


def _two_holds(key: tuple) -> tuple[shared.Lease, shared.Lease]:
    kept = shared.join(key)
    return kept, SlowToCheck(shared.join(key).entry)


def test_a_lease_released_by_many_threads_at_once_counts_once():
    # Two threads closing one calculator release one lease twice: counted twice, the
    # worker would stop under the calculators still holding it.
    for trial in range(5):
        key = ("test_shared_races", trial)
        kept, raced = _two_holds(key)
        assert _at_once(lambda _i, lease=raced: shared.release(lease)) == []
        assert kept.entry.holders == 1, f"trial {trial}: one release was counted more than once"
        assert key in shared.held_keys()
        shared.release(kept)
        assert key not in shared.held_keys()


def test_a_holder_left_by_many_threads_at_once_releases_once():
    for trial in range(5):
        key = ("test_shared_races.holder", trial)
        kept, raced = _two_holds(key)
        holder = shared.Holder()
        holder.lease = raced
        assert _at_once(lambda _i, held=holder: held.leave()) == []
        assert holder.lease is None
        assert kept.entry.holders == 1, f"trial {trial}: one leave was counted more than once"
        shared.release(kept)
        assert key not in shared.held_keys()


def test_state_written_by_many_threads_at_once_is_always_whole(tmp_path: Path, eager_switching):
    # The pool daemon publishes its state from its main loop and from client threads.
    state = tmp_path / "0123456789abcdef.json"
    write_json_atomic(state, {"writer": -1, "pad": ""})
    seen: list[str] = []
    done = threading.Event()

    def read_while_written() -> None:
        while not done.is_set():
            seen.append(state.read_text())

    reader = threading.Thread(target=read_while_written)
    reader.start()
    try:
        # Texts of different lengths: a torn write shows as one that does not parse.
        errors = _at_once(
            lambda i: [
                write_json_atomic(state, {"writer": i, "round": n, "pad": "x" * (i * 97 + n % 13)})
                for n in range(200)
            ]
        )
    finally:
        done.set()
        reader.join(timeout=30)
    assert errors == [], f"writers failed: {errors[:3]}"
    for text in [*seen, state.read_text()]:
        record = json.loads(text)  # never empty, never torn
        assert record["pad"] == "x" * len(record["pad"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [state.name], "a file aside was left"


def test_a_client_threads_retire_never_breaks_the_main_loops_accept(short_tmp_path: Path):
    # A client thread that gives up the worker retires the socket while the main loop
    # sits in accept(): it closed the listener under accept, which died with EBADF.
    from rootstock.install.layout import InstallLayout
    from rootstock.runtime.pool.daemon import PoolDaemon
    from rootstock.runtime.pool.directory import PoolFiles
    from rootstock.runtime.spec import WorkerSpec

    spec = WorkerSpec(
        layout=InstallLayout(root=short_tmp_path / "root", cache_root=short_tmp_path / "cache"),
        checkpoint="emt",
        env_name="emt",
        device="cpu",
    )
    for trial in range(6):
        daemon = PoolDaemon(
            spec,
            PoolFiles(short_tmp_path, f"{trial:016x}"),
            idle_timeout=600,
            startup_timeout=None,
        )
        daemon.bind()
        main, errors = _started(lambda _i, d=daemon: d.serve())
        time.sleep(0.02 * trial)  # inside accept() by now, or about to be
        assert _at_once(lambda _i, d=daemon: d.request_retire(), threads=2) == []
        assert not daemon.files.socket.exists()
        wait_for(lambda d=daemon: d._listener is None, 30, "the main loop to close the listener")
        daemon.stop_requested.set()
        _joined(main)
        assert errors == [], f"trial {trial}: the main loop raised {errors[0]!r}"
