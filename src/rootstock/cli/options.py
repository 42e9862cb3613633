"""The numeric option types every command parses with (one place, one rule).

A number on the command line is checked where click parses it, before the command
runs: a bad one is a usage error (exit code 2) that names the option and the
accepted range, and nothing has been read or written yet. So ``add
--verify-timeout 0`` can never be recorded as a failed verification, and
``--jobs 10**9`` never reaches a thread pool.

Floats must be finite (``nan`` compares false with every bound, so a plain
``click.FloatRange`` lets it through), and every range is closed above: a timeout
of ``1e308`` s overflows the C ``timeval`` that sockets and locks wait with.
"""

from __future__ import annotations

import math
from typing import Any

import click

# A year: longer than any batch allocation, far below what socket timeouts accept.
MAX_SECONDS = 365 * 24 * 3600.0
# More concurrent verifications than any node has devices for.
MAX_JOBS = 256
# A walk longer than this is a typo (a million calls of a fast model take hours).
MAX_CALLS = 1_000_000


class Seconds(click.ParamType):
    """A duration in seconds: finite, above zero (or exactly 0 when that means
    "forever"), at most :data:`MAX_SECONDS`."""

    name = "seconds"

    def __init__(self, zero_means: str | None = None, maximum: float = MAX_SECONDS) -> None:
        self.zero_means = zero_means
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        """Parse ``value`` (a string from the command line, or a default)."""
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds; {self._range()}", param, ctx)
        if seconds == 0 and self.zero_means:
            return 0.0
        if seconds <= 0 or seconds > self.maximum:
            self.fail(f"{value!r} is out of range; {self._range()}", param, ctx)
        return seconds

    def _range(self) -> str:
        text = f"give more than 0 and at most {self.maximum:g} seconds"
        if self.zero_means:
            text += f" (or 0: {self.zero_means})"
        return text

    def __repr__(self) -> str:
        return f"Seconds(max={self.maximum:g})"


class Count(click.ParamType):
    """A whole number in ``[minimum, maximum]`` (both inclusive)."""

    name = "integer"

    def __init__(self, minimum: int, maximum: int) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        """Parse ``value``; ``2.0``, ``1e3`` and ``true`` are not whole numbers here."""
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a whole number", param, ctx)
        if isinstance(value, int):
            number = value
        else:
            try:
                number = int(str(value).strip(), 10)
            except ValueError:
                self.fail(f"{value!r} is not a whole number", param, ctx)
        if not self.minimum <= number <= self.maximum:
            self.fail(
                f"{value!r} is out of range; give {self.minimum} to {self.maximum}", param, ctx
            )
        return number

    def __repr__(self) -> str:
        return f"Count({self.minimum}, {self.maximum})"


def timeout_seconds(zero_means: str | None = None) -> Seconds:
    """The type of every ``--*-timeout`` option."""
    return Seconds(zero_means=zero_means)


JOBS = Count(1, MAX_JOBS)
CALLS = Count(1, MAX_CALLS)
WARMUP = Count(0, MAX_CALLS)
EVERY_N = Count(1, 1_000_000_000)
PORT = Count(0, 65535)
# 1 KiB (a push is never smaller) to 1 TiB (beyond that is a typo).
BODY_BYTES = Count(1024, 2**40)
