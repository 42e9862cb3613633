"""The lifeline itself: EOF reaches the watcher when, and only when, the starter lets go.

The read end is watched in this very process (a dup of it, as a child would hold
it), so these tests start no subprocess. The one that forks, to show a forked copy
of the starter does not keep a child alive, is in tests/integration/test_lifeline_fork.py.
"""

from __future__ import annotations

import os
import threading

import pytest

from rootstock.wire import lifeline as lifeline_module
from rootstock.wire.lifeline import LIFELINE_OPTION, Lifeline, watch_lifeline

pytestmark = pytest.mark.timeout(30)


def watched(lifeline: Lifeline) -> tuple[threading.Event, int]:
    """Watch a copy of the read end, as the child would; the event is set on EOF."""
    read_end = os.dup(lifeline.child_fd)
    lifeline.child_started()
    lost = threading.Event()
    watch_lifeline(read_end, lost.set)
    return lost, read_end


def test_eof_reaches_the_watcher_only_when_the_starter_closes():
    lifeline = Lifeline()
    lost, read_end = watched(lifeline)
    try:
        assert not lost.wait(0.3), "EOF before the write end was closed"
        lifeline.close()
        assert lost.wait(5)
    finally:
        os.close(read_end)


def test_child_started_drops_only_the_read_end():
    lifeline = Lifeline()
    child_fd = lifeline.child_fd
    lifeline.child_started()
    assert lifeline.child_fd == -1
    with pytest.raises(OSError):
        os.fstat(child_fd)
    lifeline.child_started()  # idempotent
    lifeline.close()
    lifeline.close()


def test_a_dropped_lifeline_closes_its_fds():
    lifeline = Lifeline()
    lost, read_end = watched(lifeline)
    try:
        del lifeline
        assert lost.wait(5)
    finally:
        os.close(read_end)


def test_the_watched_fd_is_not_inherited_by_grandchildren():
    lifeline = Lifeline()
    read_end = os.dup(lifeline.child_fd)
    os.set_inheritable(read_end, True)
    lifeline.child_started()
    watch_lifeline(read_end, lambda: None)
    try:
        assert not os.get_inheritable(read_end)
    finally:
        lifeline.close()
        os.close(read_end)


def test_lifelines_closed_before_a_fork_are_not_touched_in_the_child():
    first = Lifeline()
    first.close()
    assert first not in lifeline_module._OPEN
    second = Lifeline()
    assert second in lifeline_module._OPEN
    second.close()
    assert second not in lifeline_module._OPEN


def test_script_command_runs_this_file_by_path():
    from rootstock.wire.lifeline import script_command

    argv = script_command("/env/bin/python", 7, "/x/probe.py", ["a", "b"])
    assert argv[:2] == ["/env/bin/python", "-I"]
    assert argv[argv.index(LIFELINE_OPTION) + 1] == "7"
    assert argv[-3:] == ["/x/probe.py", "a", "b"]
    assert argv[argv.index(LIFELINE_OPTION) - 1] == os.path.abspath(lifeline_module.__file__)


@pytest.mark.parametrize(
    "argv", [[], [LIFELINE_OPTION, "3"], ["--other", "3", "s.py"], [LIFELINE_OPTION, "x", "s.py"]]
)
def test_the_runner_refuses_bad_arguments(argv, capsys):
    assert lifeline_module.run_script(argv) == 2
    assert "usage" in capsys.readouterr().err
