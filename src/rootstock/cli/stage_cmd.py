"""``rootstock stage``: put builds on this node's disk before workers start."""

from __future__ import annotations

import sys

import click

from rootstock.cli.common import console, emit_json, layout_from, print_table, root_options, table

_MODES = click.Choice(["auto", "mount", "copy"], case_sensitive=False)


@click.command()
@click.argument("targets", nargs=-1, metavar="CHECKPOINT|ENV...")
@root_options
@click.option("--all", "everything", is_flag=True, help="Stage every installed env.")
@click.option(
    "--mode",
    type=_MODES,
    default=None,
    help="mount (squashfuse) or copy (extract); default: $ROOTSTOCK_STAGE, config, auto.",
)
@click.option("--list", "show", is_flag=True, help="Show your stages on this node.")
@click.option("--clean", is_flag=True, help="Remove your stages on this node that no worker uses.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def stage(
    targets: tuple[str, ...],
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    everything: bool,
    mode: str | None,
    show: bool,
    clean: bool,
    as_json: bool,
) -> None:
    """Stage builds on this node, so that workers start from local disk.

    Run it in a job's prologue: each build's image is read once from the shared
    filesystem, checked against its recorded sha256, and mounted (squashfuse) or
    extracted under $ROOTSTOCK_STAGE_DIR, else $TMPDIR, else /tmp. Workers stage by
    themselves too; this only does it ahead of time. Exit code 1 when a build could
    not be staged.
    """
    from rootstock.errors import UsageError

    if sum((show, clean, bool(targets) or everything)) > 1:
        raise UsageError(
            "stage takes targets (or --all), --list or --clean, one at a time",
            hint="e.g. `rootstock stage chgnet-0.3.0`, `rootstock stage --list`",
        )
    if show:
        _show(as_json)
        return
    if clean:
        _clean(as_json)
        return
    from rootstock.ops.stage import envs_named, stage_envs
    from rootstock.runtime import stage_mode

    chosen = stage_mode(mode)
    if chosen == "off":
        raise UsageError(
            "staging is off ($ROOTSTOCK_STAGE or config.toml says stage = off)",
            hint="pass --mode auto, mount or copy to stage anyway",
        )
    layout = layout_from(root, cluster, cache_root)
    names = envs_named(layout, list(targets), everything, cluster)
    outcomes = stage_envs(layout, names, chosen)
    if as_json:
        emit_json([o.to_dict() for o in outcomes])
    else:
        for outcome in outcomes:
            if outcome.status == "staged":
                click.echo(
                    f"staged {outcome.env} ({outcome.mode}) at {outcome.path} "
                    f"in {outcome.seconds:.1f} s"
                )
            else:
                click.echo(f"{outcome.env}: not staged: {outcome.message}", err=True)
    if any(o.status == "refused" for o in outcomes):
        sys.exit(1)


def _show(as_json: bool) -> None:
    from rootstock.ops.stage import stages_here

    entries = stages_here()
    if as_json:
        emit_json([e.to_dict() for e in entries])
        return
    if not entries:
        click.echo("no stages on this node")
        return
    tab = table(None, ["STAGE", "ENV", "HOW", "IN USE", "CURRENT", "SIZE"], whole=("STAGE", "ENV"))
    for e in entries:
        how = "mounted" if e.mounted else "extracted" if e.extracted else "image only"
        tab.add_row(
            e.name,
            e.env or "?",
            how,
            "yes" if e.in_use else "no",
            "yes" if e.current else "no (removed when unused)",
            f"{e.size / 1e6:.0f} MB",
        )
    print_table(console(), tab)


def _clean(as_json: bool) -> None:
    from rootstock.ops.stage import clean_here

    removed, kept = clean_here()
    if as_json:
        emit_json({"removed": removed, "kept_in_use": kept})
        return
    for name in removed:
        click.echo(f"removed {name}")
    for name in kept:
        click.echo(f"kept {name}: a worker uses it", err=True)
    if not removed and not kept:
        click.echo("no stages on this node")
