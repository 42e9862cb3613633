"""``rootstock list``."""

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


@click.command("list")
@root_options
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def list_envs(root: str | None, cluster: str | None, cache_root: str | None, as_json: bool) -> None:
    """List installed envs, their checkpoint ids, custom entries and variants."""
    from rich.markup import escape

    from rootstock.ops.listing import list_envs as run_list

    result = run_list(layout_from(root, cluster, cache_root))
    if as_json:
        emit_json(result)
        return
    for line in result["warnings"]:
        warn(line)
    if not result["envs"]:
        click.echo(
            f"no envs installed in {result['root']}; try: rootstock install environments/emt.py"
        )
        return
    tab = table(
        f"envs in {result['root']}",
        ["env", "checkpoints", "custom", "licence", "clusters"],
        whole=("env",),
    )
    for env in result["envs"]:
        if env["error"]:
            # The ids shown are the manifest's record; the file itself cannot be read.
            clusters = f"[red]broken: {escape(env['error'])}[/red]"
        else:
            clusters = ", ".join(env["clusters"]) if env["clusters"] else "all"
        tab.add_row(
            env["name"],
            ", ".join(c + (" (gated)" if c in env["gated"] else "") for c in env["checkpoints"])
            or "-",
            ", ".join(env["custom"]) or "-",
            escape(describe_licences(env["licences"], env["checkpoints"])),
            clusters,
        )
    print_table(console(), tab)


def describe_licences(licences: dict[str, str | None], ids: list[str]) -> str:
    """The licence cell of one env: ``MIT`` when its named ids share one licence, else
    each licence followed by its ids; ids with no declared licence are left out."""
    by_licence: dict[str, list[str]] = {}
    for checkpoint in ids:
        licence = licences.get(checkpoint)
        if licence:
            by_licence.setdefault(licence, []).append(checkpoint)
    if not by_licence:
        return "-"
    if len(by_licence) == 1:
        return next(iter(by_licence))
    return "; ".join(f"{licence} ({', '.join(named)})" for licence, named in by_licence.items())
