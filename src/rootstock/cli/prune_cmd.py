"""``rootstock prune``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from rootstock.cli.common import emit_json, layout_from, progress, root_options
from rootstock.cli.options import HOURS

if TYPE_CHECKING:
    from rootstock.ops.prune import PruneReport
    from rootstock.ops.prune_plan import PruneEntry, PrunePlan

_KIND_WORDS = {
    "env": ("env", "envs"),
    "checkpoint": ("checkpoint record", "checkpoint records"),
    "staging": ("stale staging", "stale stagings"),
    "generation": ("old generation", "old generations"),
    "interpreter": ("unused interpreter", "unused interpreters"),
    "lockfile": ("orphaned lockfile", "orphaned lockfiles"),
    "unattributed": ("unattributed dir", "unattributed dirs"),
    "uv-cache": ("uv cache prune", "uv cache prunes"),
}


@click.command()
@click.argument("source", required=False)
@root_options
@click.option("--dry-run", is_flag=True, help="Show the plan; delete nothing (exit code 0).")
@click.option(
    "--deep", is_flag=True, help="Also delete content in cache/ and home/ no record lists."
)
@click.option(
    "--min-age",
    type=HOURS,
    default=24.0,
    show_default=True,
    metavar="HOURS",
    help="Collect garbage only once it is this old (0: whatever its age).",
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask; needed without a terminal.")
@click.option("--no-push", is_flag=True, help="Do not push the manifest to the dashboard.")
@click.option("--no-perm-check", is_flag=True, help="Skip the up-front permission check.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and results as JSON.")
def prune(
    source: str | None,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    dry_run: bool,
    deep: bool,
    min_age: float,
    yes: bool,
    no_push: bool,
    no_perm_check: bool,
    as_json: bool,
) -> None:
    """Remove what SOURCE no longer declares, and collect the garbage.

    SOURCE is a directory of env files or git+URL[@REF][#subdirectory=DIR];
    without it, envs with no registered source in {root}/environments/ go. A
    SOURCE that cannot be read, is empty, or holds an env file failing the lint
    prunes nothing. Asks before deleting; without a terminal, pass --yes.
    """
    from rootstock.errors import UsageError
    from rootstock.ops.prune import prune as run_prune
    from rootstock.ops.prune_plan import plan_prune
    from rootstock.ops.sources import open_source

    if source is not None and not source.strip():
        raise UsageError("SOURCE cannot be empty", hint="omit it to use the registered sources")
    layout = layout_from(root, cluster, cache_root)
    with open_source(layout, source) as opened:
        plan = plan_prune(
            layout,
            opened,
            deep=deep,
            min_age_s=min_age * 3600,
            cluster=cluster,
        )
        if dry_run or plan.empty:
            if as_json:
                emit_json(
                    {
                        "dry_run": dry_run,
                        "plan": plan.to_dict(),
                        "results": [],
                        "finished_journal": None,
                        "reclaimed_bytes": 0,
                        "ok": True,
                    }
                )
            else:
                render_plan(plan, dry_run)
            return
        interactive = not yes and sys.stdin.isatty()
        if not yes and not interactive:
            raise UsageError(
                "refusing to prune without confirmation: stdin is not a terminal",
                hint="see the plan with `rootstock prune --dry-run` (same arguments), "
                "then pass --yes to carry it out",
            )
        if not as_json or interactive:
            render_plan(plan, dry_run=False, err=as_json)
        if interactive and not click.confirm("Delete all of this?", default=False, err=True):
            click.echo("aborted: nothing was pruned", err=True)
            raise click.exceptions.Exit(1)
        if not no_perm_check:
            from rootstock.cli.perms_cmd import warn_about_perms

            warn_about_perms(layout)
        with progress(enabled=not as_json) as step:
            report = run_prune(layout, plan, step=step)
    if as_json:
        emit_json(report.to_dict())
    else:
        render_report(report)
    if report.dropped_records:
        from rootstock.cli.push_hooks import auto_push_dashboard, push_after

        push_after("prune", layout, auto_push_dashboard(no_push))
    if not report.ok:
        raise click.exceptions.Exit(1)


def human_bytes(n: int | None) -> str:
    """``12.3 MiB``; ``?`` for a size known only afterwards."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _label(entry: PruneEntry) -> str:
    if entry.kind == "checkpoint":
        return f"checkpoint {entry.name} (env {entry.env})"
    return f"{entry.kind} {entry.name}"


def render_plan(plan: PrunePlan, dry_run: bool, err: bool = False) -> None:
    """The plan, terraform-style: ``-`` goes, ``=`` is kept, then the unattributed summary."""

    def say(text: str = "") -> None:
        click.echo(text, err=err)

    where = f"source {plan.source.label}" if plan.source else "registered sources"
    cluster = f", cluster {plan.cluster}" if plan.cluster else ""
    head = "dry run: nothing is deleted" if dry_run else "prune plan"
    say(f"{head} ({plan.root}{cluster}; {where}; --min-age {plan.min_age_s / 3600:g} h)")
    for entry in plan.entries:
        say(f"  - {_label(entry)}  [{human_bytes(entry.bytes)}]")
        say(f"      {entry.reason}")
        if entry.kind == "checkpoint" and entry.paths:
            say(
                f"      files: {', '.join(entry.paths[:5])}"
                + (" ..." if len(entry.paths) > 5 else "")
            )
        if entry.kind == "unattributed":
            say(f"      {entry.count} file(s)")
    for entry in plan.kept:
        say(f"  = keep {_label(entry)}: {entry.reason}")
    summary = plan.unattributed
    if summary.files:
        dirs = ", ".join(
            f"{top} ({n} files, {human_bytes(size)})"
            for top, (n, size) in sorted(summary.dirs.items())
        )
        deleted = "deleted with --deep" if plan.deep else "deleted only with --deep"
        young = f", {summary.young} younger than --min-age" if summary.young else ""
        say(
            f"unattributed in cache/ and home/: {summary.files} file(s), "
            f"{human_bytes(summary.bytes)}{young} ({deleted}): {dirs}"
        )
    for note in plan.notes:
        say(f"note: {note}")
    if plan.empty:
        say("nothing to prune")
        return
    counts = ", ".join(f"{n} {_KIND_WORDS[kind][n != 1]}" for kind, n in plan.counts().items())
    say(f"plan: {counts}; {human_bytes(plan.bytes)} to reclaim")


def render_report(report: PruneReport) -> None:
    """One line per entry, then the totals."""
    journal = report.finished_journal
    if journal is not None:
        click.echo(
            f"finished an interrupted prune: {len(journal.deleted)} deleted, "
            f"{len(journal.spared)} spared, {len(journal.failed)} failed "
            f"({human_bytes(journal.freed_bytes)})"
        )
        for line in journal.failed:
            click.echo(f"error: {line}", err=True)
    counts: dict[str, int] = {}
    for result in report.results:
        counts[result.status] = counts.get(result.status, 0) + 1
        name = f"{result.kind} {result.name}" + (f" (env {result.env})" if result.env else "")
        tail = f": {result.message}" if result.message else ""
        if result.status == "failed":
            click.echo(f"error: could not delete {name}{tail}", err=True)
        else:
            click.echo(f"{result.status} {name} [{human_bytes(result.bytes)}]{tail}")
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    click.echo(f"pruned: {summary or 'nothing'}; {human_bytes(report.reclaimed_bytes)} reclaimed")
