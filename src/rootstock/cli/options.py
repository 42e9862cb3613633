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
from collections.abc import Callable
from typing import Any, TypeVar

import click

from rootstock.errors import UsageError

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

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
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

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
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


class Hours(click.ParamType):
    """An age in hours: finite, 0 or more, at most :data:`MAX_SECONDS` (a year)."""

    name = "hours"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        """Parse ``value`` into hours (``0`` means "whatever its age")."""
        if isinstance(value, bool):
            self.fail(f"{value!r} is not a number of hours", param, ctx)
        try:
            hours = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of hours", param, ctx)
        maximum = MAX_SECONDS / 3600
        if not math.isfinite(hours) or not 0 <= hours <= maximum:
            self.fail(f"{value!r} is out of range; give 0 to {maximum:g} hours", param, ctx)
        return hours


def timeout_seconds(zero_means: str | None = None) -> Seconds:
    """The type of every ``--*-timeout`` option."""
    return Seconds(zero_means=zero_means)


JOBS = Count(1, MAX_JOBS)
CALLS = Count(1, MAX_CALLS)
WARMUP = Count(0, MAX_CALLS)
EVERY_N = Count(1, 1_000_000_000)
HOURS = Hours()
PORT = Count(0, 65535)
# 1 KiB (a push is never smaller) to 1 TiB (beyond that is a typo).
BODY_BYTES = Count(1024, 2**40)


class CheckedBy(click.ParamType):
    """A value that one shared rule checks (or normalises); its refusal exits 2.

    ``check`` returns the value to use, or raises
    :class:`~rootstock.errors.UsageError`, whose message and hint become click's.
    The rules live below the CLI (:mod:`rootstock.names`, the ops), so a name or
    value the CLI accepts is never refused by the layer it reaches.
    """

    def __init__(self, name: str, check: Callable[[Any], Any]) -> None:
        self.name = name
        self.check = check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Return ``check(value)``, or fail with the rule's message and hint."""
        try:
            return self.check(value)
        except UsageError as exc:
            self.fail(f"{exc.message}; {exc.hint}" if exc.hint else exc.message, param, ctx)


def _cluster_name(value: Any) -> str:
    # Imported when an option is parsed, so --help loads none of it.
    from rootstock.names import cluster_name

    return cluster_name(value)


def _device_name(value: Any) -> str:
    from rootstock.names import device_name

    return device_name(value)


def _setup_kwargs(value: Any) -> dict[str, Any] | None:
    if isinstance(value, dict):
        return value  # click converts a default (or a converted value) again
    from rootstock.ops.benchmark_system import parse_setup_kwargs

    return parse_setup_kwargs(value)


class NonEmptyPath(click.Path):
    """A ``click.Path`` that refuses the empty string.

    ``--root "$ROOT"`` with ``$ROOT`` unset passes ``""``, which every resolver
    reads as "not given" and would silently fall back to another install.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Refuse ``""`` (and all-blank text), else convert as ``click.Path`` does."""
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path is not a path; omit the option to use the default", param, ctx)
        return super().convert(value, param, ctx)


def directory() -> NonEmptyPath:
    """The type of ``--root`` and ``--cache-root``: a directory (or one to create)."""
    return NonEmptyPath(file_okay=False)


# Cluster names are stripped and lower-cased (``names.cluster_name``); the same rule
# holds whether the name picks a registry entry or is recorded in the manifest.
CLUSTER = CheckedBy("cluster", _cluster_name)
# cpu, cuda[:N], xpu[:N], gpu[:N], mps, rocm or hip (``names.device_name``).
DEVICE = CheckedBy("device", _device_name)
# A standard JSON object nested at most install.parsing.MAX_KWARG_DEPTH deep.
SETUP_KWARGS = CheckedBy("json", _setup_kwargs)

F = TypeVar("F", bound=Callable[..., Any])


def device_option(help: str = "Passed to setup().") -> Callable[[F], F]:
    """``--device`` (default ``cuda``), checked by :data:`DEVICE`; ``help`` says what for."""
    return click.option("--device", type=DEVICE, default="cuda", show_default=True, help=help)


def kwarg_option(
    help: str = "Keyword for setup(); VALUE is JSON if it parses, else a string. Repeatable.",
    metavar: str = "KEY=VALUE",
) -> Callable[[F], F]:
    """``--kwarg``, repeatable, into the ``kwarg_pairs`` parameter.

    The pairs reach the command as typed: it parses them with
    :func:`rootstock.cli.kwargs.parse_kwargs` when it chooses, so ``add`` reports a
    bad pair before it resolves the root.
    """
    return click.option("--kwarg", "kwarg_pairs", multiple=True, metavar=metavar, help=help)


# Every command that starts a worker for a ``<family>:custom`` id takes the same option.
weights_option = click.option(
    "--weights", type=click.Path(), help="Your weights, for <family>:custom ids."
)

# add, smoke-test and sync verify with the same bound on each forward pass.
verify_timeout_option = click.option(
    "--verify-timeout",
    type=timeout_seconds(),
    default=600.0,
    show_default=True,
    help="Seconds to wait for each forward pass.",
)

# smoke-test and sync push snapshots the same way.
push_every_option = click.option(
    "--push-every",
    type=EVERY_N,
    metavar="N",
    help="Push a manifest snapshot to the dashboard after every N results.",
)


def setup_options(command: F) -> F:
    """``--device``, ``--kwarg`` and ``--weights``: how a command that serves a model sets
    it up (``serve``, ``lammps``)."""
    return device_option()(kwarg_option()(weights_option(command)))
