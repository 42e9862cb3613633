"""tests/unit starts no process: each test's setup, call and teardown run with every
way of starting one refused.

A test that needs a subprocess, a fork or a real worker belongs in tests/integration
(house style: unit tests are fast and in-process). The guard refuses at the lowest
doors, so ``subprocess.run``, ``os.popen``, ``pty.fork``, ``multiprocessing`` (fork,
spawn and forkserver alike) and asyncio's subprocesses are all caught. An attempt
that the code under test catches and swallows still fails the test afterwards.
"""

from __future__ import annotations

import _posixsubprocess  # the fork+exec below subprocess and multiprocessing's spawn
import contextlib
import os
import subprocess
from collections.abc import Callable, Generator, Iterator
from typing import Any, NoReturn

import pytest

#: Where processes start: (owner, attribute, the name an error shows).
_DOORS: tuple[tuple[object, str, str], ...] = (
    (subprocess.Popen, "__init__", "subprocess.Popen"),
    (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (os, "system", "os.system"),
)
_ATTEMPTS = pytest.StashKey[list[str]]()


class ProcessStartedInUnitTest(AssertionError):
    """A test under tests/unit tried to start a process."""


def _refuse(door: str, attempts: list[str]) -> Callable[..., NoReturn]:
    def refused(*_args: Any, **_kwargs: Any) -> NoReturn:
        attempts.append(door)
        raise ProcessStartedInUnitTest(
            f"{door}() was called: tests/unit starts no process; "
            "make the test in-process or move it to tests/integration"
        )

    return refused


@contextlib.contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    attempts = item.stash.setdefault(_ATTEMPTS, [])
    try:
        with pytest.MonkeyPatch.context() as patch:
            for owner, attribute, door in _DOORS:
                if hasattr(owner, attribute):  # posix_spawn and forkpty are not everywhere
                    patch.setattr(owner, attribute, _refuse(door, attempts))
            yield
    finally:
        # Reported once: a refusal that propagated has failed this phase already.
        tried = ", ".join(dict.fromkeys(attempts))
        attempts.clear()
    if tried:
        raise ProcessStartedInUnitTest(
            f"{item.nodeid} tried to start a process ({tried}) and carried on; "
            "tests/unit starts none: make it in-process or move it to tests/integration"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    with _no_processes(item):
        return (yield)


@pytest.fixture
def refused_process_starts(request: pytest.FixtureRequest) -> list[str]:
    """The doors this test knocked on so far; the guard's own test empties it."""
    return request.node.stash.setdefault(_ATTEMPTS, [])
