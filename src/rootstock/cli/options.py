"""The option types every command parses with: numbers, names, devices, JSON.

One place, one rule each. Cluster names and device strings follow
:mod:`rootstock.names` (the rule the manifest, the registry and the dashboard
share), so ``manifest init --cluster "Bad Name!"`` and ``add --device ../../etc``
are usage errors before anything is read or written.

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

from rootstock.errors import UsageError
from rootstock.ops.kwargs import MAX_KWARG_DEPTH

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


class ClusterName(click.ParamType):
    """A cluster name by :func:`rootstock.names.cluster_name`, returned lower-case.

    The same rule holds whether the name picks a registry entry or is recorded in
    the manifest: a name the manifest would refuse can never select anything.
    """

    name = "cluster"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        """Normalise ``value`` (strip, lower-case) or fail naming the rule."""
        from rootstock.names import cluster_name

        try:
            return cluster_name(value)
        except UsageError as exc:
            self.fail(f"{exc.message}; {exc.hint}", param, ctx)


class DeviceName(click.ParamType):
    """A device string by :func:`rootstock.names.device_name` (``cpu``, ``cuda:1``, ...)."""

    name = "device"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        """Return ``value`` stripped, or fail listing the accepted devices."""
        from rootstock.names import device_name

        try:
            return device_name(value)
        except UsageError as exc:
            self.fail(f"{exc.message}; {exc.hint}", param, ctx)


class JsonObject(click.ParamType):
    """A JSON object (``--setup-kwargs``): standard JSON, nested at most ``max_depth``."""

    name = "json"

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        """Parse ``value`` with the strict reader; a dict, or a usage error that says why."""
        from rootstock.install.parsing import ParseProblem, TooDeep, loads_json

        if isinstance(value, dict):
            return value
        option = param.opts[0] if param is not None and param.opts else "the value"
        example = 'e.g. \'{"task": "omat"}\''
        try:
            parsed = loads_json(value, max_depth=self.max_depth)
        except TooDeep:
            self.fail(f"{option} is nested deeper than {self.max_depth} levels", param, ctx)
        except ParseProblem as exc:
            self.fail(
                f"{option} is not valid JSON: {exc}; pass a JSON object, {example}", param, ctx
            )
        if not isinstance(parsed, dict):
            self.fail(
                f"{option} must be a JSON object, not {type(parsed).__name__}; {example}",
                param,
                ctx,
            )
        return parsed


class NonEmptyPath(click.Path):
    """A ``click.Path`` that refuses the empty string.

    ``--root "$ROOT"`` with ``$ROOT`` unset passes ``""``, which every resolver
    reads as "not given" and would silently fall back to another install.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None):
        """Refuse ``""`` (and all-blank text), else convert as ``click.Path`` does."""
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path is not a path; omit the option to use the default", param, ctx)
        return super().convert(value, param, ctx)


def directory() -> NonEmptyPath:
    """The type of ``--root`` and ``--cache-root``: a directory (or one to create)."""
    return NonEmptyPath(file_okay=False)


CLUSTER = ClusterName()
DEVICE = DeviceName()
SETUP_KWARGS = JsonObject(MAX_KWARG_DEPTH)
