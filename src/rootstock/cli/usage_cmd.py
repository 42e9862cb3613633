"""``rootstock usage report | compact | push``: the anonymous usage statistics."""

from __future__ import annotations

import click

from rootstock.cli.common import (
    console,
    emit_json,
    layout_from,
    print_table,
    root_options,
    table,
    warn,
)


@click.group("usage")
def usage() -> None:
    """Aggregate the anonymous usage records of an install (docs/usage-statistics.md)."""


@usage.command("report")
@root_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--since", metavar="YYYY-MM", help="Only months from this one on.")
def report(
    root: str | None, cluster: str | None, cache_root: str | None, as_json: bool, since: str | None
) -> None:
    """Distinct users, sessions and force calls by month, env and checkpoint."""
    from rootstock.install.usage import TORN_RECORD_MAX_AGE_DAYS
    from rootstock.ops.usage import check_month, usage_report

    check_month(since)
    result = usage_report(layout_from(root, cluster, cache_root), since=since)
    if as_json:
        emit_json(result)
        return
    if result["unreadable_records"]:
        warn(
            f"{result['unreadable_records']} record(s) could not be read and were skipped "
            f"(`usage compact` deletes them once they are {TORN_RECORD_MAX_AGE_DAYS} days old)"
        )
    if result["rollup_entries_out_of_bounds"]:
        warn(
            f"{result['rollup_entries_out_of_bounds']} rollup entr(ies) hold names or counts "
            "the dashboard refuses: left out or capped here; `rootstock usage compact` "
            "repairs the rollup files"
        )
    if not result["rows"]:
        click.echo(f"no usage recorded in {result['spool']}")
        return
    tab = table(
        f"usage in {result['spool']}",
        ["month", "env", "checkpoint", "users", "sessions", "force calls"],
        whole=("env", "checkpoint"),
    )
    for row in result["rows"]:
        tab.add_row(
            row["month"],
            row["env"],
            row["checkpoint"],
            str(row["users"]),
            str(row["sessions"]),
            str(row["force_calls"]),
        )
    totals = result["totals"]
    tab.add_row(
        "total", "", "", str(totals["users"]), str(totals["sessions"]), str(totals["force_calls"])
    )
    print_table(console(), tab)


@usage.command("compact")
@root_options
def compact(root: str | None, cluster: str | None, cache_root: str | None) -> None:
    """Fold raw records into monthly rollups and delete the folded records."""
    from rootstock.install.usage import TORN_RECORD_MAX_AGE_DAYS
    from rootstock.ops.usage import compact as run_compact

    result = run_compact(layout_from(root, cluster, cache_root))
    click.echo(
        f"folded {result.folded} record(s) into {len(result.months)} month(s); "
        f"deleted {result.deleted}"
    )
    if result.torn_removed:
        click.echo(
            f"removed {result.torn_removed} unreadable record(s) older than "
            f"{TORN_RECORD_MAX_AGE_DAYS} days"
        )
    if result.torn_kept:
        warn(
            f"{result.torn_kept} unreadable record(s) skipped and kept (younger than "
            f"{TORN_RECORD_MAX_AGE_DAYS} days, or not yours to delete); they are never counted"
        )
    if result.salt_removed:
        click.echo(
            "removed the old salt (.salt): records now carry random ids, and the salt "
            "let anyone recompute older records' user hashes"
        )
    for month, repairs in result.repaired.items():
        for repair in repairs:
            warn(f"repaired usage rollup {month}: {repair}")
    if result.undeletable:
        warn(
            f"{len(result.undeletable)} folded record(s) could not be deleted (run compact as "
            "the spool's owner); they stay named in the rollups and are never counted twice"
        )


@usage.command("push")
@root_options
@click.option("--since", metavar="YYYY-MM", help="Only months from this one on.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def push(
    root: str | None, cluster: str | None, cache_root: str | None, since: str | None, as_json: bool
) -> None:
    """Send the monthly counts (as `usage report` shows them) to the dashboard.

    Only aggregates travel: sessions, distinct users and force calls per month, env
    and checkpoint, never user ids. Records do not name their cluster, so the
    counts go to --cluster (needed on a shared install). Re-sending is safe: the
    dashboard replaces a month's counts.
    """
    from rootstock.ops.push import dashboard_settings, push_usage
    from rootstock.ops.usage import check_month

    check_month(since)
    dashboard = dashboard_settings()
    report = push_usage(layout_from(root, cluster, cache_root), cluster, since, dashboard)
    if as_json:
        emit_json(report.to_dict())
    else:
        for result in report.results:
            if result.ok:
                rows = (result.response or {}).get("rows")
                click.echo(
                    f"{result.cluster}: "
                    + (result.message or f"sent {rows} row(s) to {report.api_url}")
                )
    if not report.ok:
        raise report.error()
