"""``rootstock resolve``: where an install lives, and why."""

from __future__ import annotations

import click

from rootstock.cli.common import emit_json, root_options


@click.command()
@root_options
@click.option("--json", "as_json", is_flag=True, help="Print the resolution as JSON.")
def resolve(root: str | None, cluster: str | None, cache_root: str | None, as_json: bool) -> None:
    """Show the install root and cache root, and which rule supplied each.

    Order: --root, the cluster registry entry for --cluster, $ROOTSTOCK_ROOT, then
    config.toml for the root; --cache-root, layout.json, the registry's legacy
    cache_root, then the root itself for the cache root. Lower-ranked rules that
    name another root are listed as not used.
    """
    from rootstock.install.machine import explain_resolution

    info = explain_resolution(root, cluster, cache_root)
    if as_json:
        emit_json(info)
        return
    click.echo(
        f"root:       {info['root']}  (from {info['root_source']})"
        + ("" if info["root_exists"] else "  [does not exist yet]")
    )
    for unused in info["shadowed"]:
        click.echo(f"  not used: {unused['root']}  (from {unused['source']})")
    click.echo(f"cache root: {info['cache_root']}  (from {info['cache_root_source']})")
    if info["layout_version"] is not None:
        click.echo(f"layout:     version {info['layout_version']}")
    if info["siblings"]:
        click.echo(f"clusters sharing this root: {', '.join(info['siblings'])}")
