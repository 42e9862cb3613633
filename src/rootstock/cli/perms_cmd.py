"""``rootstock setup-perms`` and ``rootstock check-perms``, and install's one-line warning."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from rootstock.cli.common import emit_json, warn
from rootstock.cli.options import CLUSTER, NonEmptyPath, directory

if TYPE_CHECKING:
    from rootstock.install.layout import InstallLayout
    from rootstock.install.perms_check import PermProblem

F = TypeVar("F", bound=Callable[..., Any])

_LOCATION = [
    click.argument("root_arg", metavar="[ROOT]", required=False, type=NonEmptyPath(dir_okay=True)),
    click.option(
        "--cluster",
        type=CLUSTER,
        help="A registered cluster: supplies the root (and a split cache root).",
    ),
    click.option(
        "--cache-root",
        type=directory(),
        help="The cache root, when it is not the one the install declares.",
    ),
]


def _location(func: F) -> F:
    for decorator in reversed(_LOCATION):
        func = decorator(func)
    return func


@click.command("setup-perms")
@_location
@click.option("--group", required=True, help="The project group that maintains the install.")
@click.option("--retrofit", is_flag=True, help="Also fix every existing file and directory.")
@click.option(
    "--usage-dir",
    type=directory(),
    help="Put the 1777 usage spool here and link {cache_root}/usage to it.",
)
@click.option("--no-usage-spool", is_flag=True, help="Create no usage spool, on purpose.")
@click.option("--apply", "do_apply", is_flag=True, help="Run the commands (default: print them).")
@click.option("-y", "--yes", is_flag=True, help="With --apply: do not ask for confirmation.")
def setup_perms(
    root_arg: str | None,
    cluster: str | None,
    cache_root: str | None,
    group: str,
    retrofit: bool,
    usage_dir: str | None,
    no_usage_spool: bool,
    do_apply: bool,
    yes: bool,
) -> None:
    """Make an install root world-readable and writable by its project group.

    Without --apply this prints the exact commands (a shell script you can review
    or run yourself). Run it once, as the maintainer, before `rootstock init`.
    """
    from rootstock.errors import UsageError
    from rootstock.ops.perms import apply_setup, plan_setup, require_tools, resolve_for_perms

    layout = resolve_for_perms(root_arg, cluster, cache_root)
    recipe = plan_setup(layout, group, retrofit, usage_dir, no_usage_spool)
    if not do_apply:
        click.echo(f"# setup-perms for {layout.root} (cache root {layout.cache_root}), ", nl=False)
        click.echo(f"group {group}: dry run; --apply runs these commands in this order")
        click.echo(recipe.script(), nl=False)
        return
    if not yes and not sys.stdin.isatty():
        raise UsageError(
            "--apply asks for confirmation, and standard input is not a terminal",
            hint="review the dry run (omit --apply), then pass --apply --yes",
        )
    require_tools(recipe)  # before the notes, which would say the same thing twice
    for note in recipe.notes:
        click.echo(f"note: {note}", err=True)
    if not yes:
        click.echo(recipe.script(), nl=False, err=True)
        click.confirm(f"Run these {len(recipe.commands)} commands?", default=False, abort=True)
    result = apply_setup(
        recipe, layout, on_command=lambda c: click.echo(f"+ {c.shell()}", err=True)
    )
    failed = result.failed
    if failed is not None:
        click.echo(
            f"error: stopped at a failed command (exit code {failed.returncode}): "
            f"{failed.command.shell()}",
            err=True,
        )
        for line in failed.output.rstrip().splitlines():
            click.echo(f"  {line}", err=True)
        click.echo(f"  {len(result.not_run)} later commands were not run", err=True)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    report = result.report
    if report is not None and report.problems:
        click.echo("the filesystem did not honour all of the recipe:", err=True)
        _print_problems(report.problems)
    if not result.ok:
        raise click.exceptions.Exit(1)
    click.echo(f"ok: {layout.root} is set up for group {group}; check-perms finds no problems")


@click.command("check-perms")
@_location
@click.option("--group", help="Also require this group to own the roots and be in their ACLs.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check_perms(
    root_arg: str | None,
    cluster: str | None,
    cache_root: str | None,
    group: str | None,
    as_json: bool,
) -> None:
    """Check that other users can use an install (read-only, stats only the roots).

    Exit code 0 when the roots look right, 1 when problems are printed.
    """
    from rootstock.ops.perms import check, resolve_for_perms

    layout = resolve_for_perms(root_arg, cluster, cache_root)
    report = check(layout, group, full=True)
    if as_json:
        emit_json(report.to_dict())
    else:
        spool = report.spool
        click.echo(f"root:        {report.root}")
        click.echo(f"cache root:  {report.cache_root}")
        if group:
            click.echo(f"group:       {group}")
        click.echo(f"usage spool: {_spool_line(spool, report.cache_root)}")
        if report.ok:
            click.echo(f"ok: {report.checked} paths checked, no problems")
        else:
            click.echo(f"{len(report.problems)} problem(s) in {report.checked} paths checked:")
            _print_problems(report.problems, err=False)
    if not report.ok:
        raise click.exceptions.Exit(1)


def warn_about_perms(layout: InstallLayout) -> None:
    """The quick check install and add run up front: one warning line on a shared root.

    A private root draws none: nobody else uses it (docs/permissions.md).
    """
    from rootstock.ops.perms import problems_for_others

    try:
        report = problems_for_others(layout)
    except Exception as exc:
        # The check is advisory: whatever goes wrong in it must not stop a build.
        warn(f"the permission check could not run: {exc}")
        return
    if report is None or report.ok:
        return
    count = len(report.problems)
    what = "1 permission problem makes" if count == 1 else f"{count} permission problems make"
    # The root is named: a bare check-perms would check the default root, not this one.
    warn(
        f"{what} this root unusable by others; run rootstock check-perms "
        f"{shlex.quote(str(layout.root))} "
        "for details"
    )


def _spool_line(spool: dict[str, Any], cache_root: Path) -> str:
    """``PATH [-> TARGET] (STATE)``, or why the spool was not looked at."""
    if spool.get("state") == "unchecked":
        return f"not checked: the cache root {cache_root} does not exist"
    target = f" -> {spool['target']}" if spool.get("target") else ""
    return f"{spool.get('path')}{target} ({spool.get('state')})"


def _print_problems(problems: Iterable[PermProblem], err: bool = True) -> None:
    for problem in problems:
        click.echo(f"  {problem.path}: {problem.message}", err=err)
        click.echo(f"    fix: {problem.fix}", err=err)
