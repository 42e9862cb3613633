"""Shared CLI pieces: root options, JSON output, tables and progress."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from rootstock.cli.options import CLUSTER, directory
from rootstock.install.layout import InstallLayout, resolve_layout

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
    """Resolve the install layout from the standard options."""
    return resolve_layout(root, cluster, cache_root, must_exist=must_exist)


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


def table(title: str | None, columns: list[str]) -> Table:
    """A rich table with the house look."""
    from rich.table import Table

    tab = Table(title=title, title_justify="left", header_style="bold", box=None, pad_edge=False)
    for column in columns:
        tab.add_column(column)
    return tab


@contextmanager
def progress(enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """Yield a ``step(message)`` reporter: a spinner on a terminal, lines otherwise."""
    err = console(stderr=True)
    if not enabled:
        yield lambda _msg: None
        return
    if not sys.stderr.isatty():
        yield lambda msg: err.print(f"[dim]…[/dim] {msg}")
        return
    with err.status("starting") as status:

        def step(msg: str) -> None:
            status.update(msg)
            err.log(msg)

        yield step


def warn(message: str) -> None:
    """Print a warning line on stderr."""
    click.echo(f"warning: {message}", err=True)
