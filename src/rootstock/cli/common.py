"""Shared CLI pieces: root options, JSON output, tables and progress."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from rootstock.cli.options import CLUSTER, directory
from rootstock.install.layout import InstallLayout
from rootstock.install.machine import resolve_machine

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

F = TypeVar("F", bound=Callable[..., Any])


def root_options(func: F) -> F:
    """Add ``--root``, ``--cluster`` and ``--cache-root`` to a command."""
    func = click.option(
        "--cache-root",
        type=directory(),
        help="Override the cache root declared in layout.json.",
    )(func)
    func = click.option(
        "--cluster",
        type=CLUSTER,
        help="The machine this runs on: a registry name, or one the install's manifest "
        "names. A registered name supplies the root unless --root is given.",
    )(func)
    func = click.option(
        "--root",
        type=directory(),
        help="The install root (default: --cluster's registry root, $ROOTSTOCK_ROOT, "
        "then config.toml).",
    )(func)
    return func


def layout_from(
    root: str | None, cluster: str | None, cache_root: str | None, must_exist: bool = True
) -> InstallLayout:
    """Resolve the install layout from the standard options (:mod:`rootstock.install.machine`)."""
    return resolve_machine(root, cluster, cache_root, must_exist=must_exist).layout


def emit_json(obj: Any) -> None:
    """Print ``obj`` as JSON on stdout (the stable, documented shape).

    Indented for a person at a terminal; compact when piped, where the C encoder
    is several times faster on large documents (``status`` of a big install).
    """
    indent = 2 if sys.stdout.isatty() else None
    click.echo(json.dumps(obj, indent=indent, sort_keys=True, default=str))


def console(stderr: bool = False) -> Console:
    """A rich console (rich is imported only by commands that draw)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def table(title: str | None, columns: list[str], whole: Collection[str] = ()) -> Table:
    """A rich table with the house look; print it with :func:`print_table`.

    The columns named in ``whole`` hold what a user copies into the next command (ids,
    names, paths): they are never wrapped or cut. Any other column may wrap, and folds
    a word too long for it onto the next line rather than cut it with ``…``.
    """
    from rich.table import Table

    tab = Table(title=title, title_justify="left", header_style="bold", box=None, pad_edge=False)
    for column in columns:
        if column in whole:
            tab.add_column(column, no_wrap=True)
        else:
            tab.add_column(column, overflow="fold")
    return tab


#: The width below which :func:`print_table` does not squeeze a wrapping column.
_NARROWEST_WRAPPED = 8


def print_table(out: Console, tab: Table) -> None:
    """Print ``tab`` as wide as the console, or wider where its whole columns need it.

    Rich fits a table to the console by narrowing the wrapping columns first, and
    cuts cells only when those cannot give enough. So the table is fitted to the
    console only when its ``no_wrap`` columns' widest cells, plus a few characters
    for every other column, fit; otherwise each row is drawn on one line at the
    table's natural width and wraps in the terminal, as ``docker ps`` and ``kubectl
    get`` rows do. Either way every id and path can still be copied whole.
    """
    from rich.measure import Measurement

    wide = out.options.update(max_width=1 << 16)
    needed = 2 * max(len(tab.columns) - 1, 0)  # the padding between columns
    for column in tab.columns:
        sizes = [Measurement.get(out, wide, c) for c in (column.header, *column.cells)]
        if column.no_wrap:
            needed += max(m.maximum for m in sizes)
        else:
            needed += min(max(m.minimum for m in sizes), _NARROWEST_WRAPPED)
    if isinstance(tab.title, str):
        # The title wraps at the table's width: a path in it stays whole only if the
        # table is at least as wide.
        title = Measurement.get(out, wide, tab.title).maximum
        tab.min_width = max(tab.min_width or 0, title)
        needed = max(needed, title)
    width = out.width
    if needed > width:
        # It cannot fit: rather than fold every other cell too, draw each row on one
        # line, at the table's natural width.
        out.width = max(needed, Measurement.get(out, wide, tab).maximum)
    try:
        out.print(tab)
    finally:
        out.width = width


@contextmanager
def progress(enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """Yield a ``step(message)`` reporter: a spinner on a terminal, lines otherwise.

    A message is printed as it is: never wrapped (rich would break it at its own
    width, 80 columns off a terminal) and never read as markup.
    """
    from rich.markup import escape

    err = console(stderr=True)
    if not enabled:
        yield lambda _msg: None
        return
    if not sys.stderr.isatty():
        yield lambda msg: err.print(f"[dim]…[/dim] {escape(msg)}", soft_wrap=True)
        return
    with err.status("starting") as status:

        def step(msg: str) -> None:
            status.update(escape(msg))
            err.log(escape(msg))

        yield step


def warn(message: str) -> None:
    """Print a warning line on stderr."""
    click.echo(f"warning: {message}", err=True)


#: Set to ``1`` (or ``true``, ``yes``, ``on``) to silence every ``next:`` hint.
NO_HINTS_ENV = "ROOTSTOCK_NO_HINTS"


def hints_wanted() -> bool:
    """False under ``rootstock --quiet`` or ``$ROOTSTOCK_NO_HINTS``: a script runs us."""
    if os.environ.get(NO_HINTS_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    ctx = click.get_current_context(silent=True)
    return not (ctx is not None and ctx.find_root().params.get("quiet"))


def next_step(command: str) -> None:
    """Print ``next: COMMAND``, the step a person usually takes next (unless silenced)."""
    if hints_wanted():
        click.echo(f"next: {command}")
