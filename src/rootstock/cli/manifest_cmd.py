"""``rootstock manifest show|init|push``."""

from __future__ import annotations

import click

from rootstock.cli.common import emit_json, layout_from, root_options
from rootstock.cli.options import CLUSTER, directory


@click.group()
def manifest() -> None:
    """Show, initialise or push the install's manifest.json."""


@manifest.command()
@root_options
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
def show(root: str | None, cluster: str | None, cache_root: str | None, as_json: bool) -> None:
    """Show the manifest (human-readable, or the full JSON)."""
    from rootstock.install.machine import served_clusters
    from rootstock.install.manifest import load_manifest

    layout = layout_from(root, cluster, cache_root)
    data = load_manifest(layout)
    if as_json:
        emit_json(data)
        return
    click.echo(f"manifest: {layout.manifest_file} (schema {data.get('schema_version')})")
    click.echo(f"clusters: {', '.join(served_clusters(layout, data)) or '-'}")
    for name, env in sorted(data.get("envs", {}).items()):
        click.echo(
            f"{name}: built {env.get('built_at')} python {env.get('python')} "
            f"torch {env.get('torch') or '-'}"
        )
        for checkpoint, entry in sorted(env.get("checkpoints", {}).items()):
            click.echo(f"  {checkpoint}: fetched {entry.get('fetched_at') or 'no'}")
            for machine, by_kind in sorted(entry.get("verifications", {}).items()):
                for kind, record in sorted(by_kind.items()):
                    click.echo(
                        f"    {machine}/{kind}: {record.get('state')} at {record.get('at')}"
                        + (f" ({record['message']})" if record.get("message") else "")
                    )


@manifest.command("init")
@click.option("--root", type=directory(), help="The install root.")
@click.option("--cache-root", type=directory(), help="Override the cache root.")
@click.option(
    "--cluster",
    "clusters",
    type=CLUSTER,
    multiple=True,
    required=True,
    help="A cluster this install serves. Repeatable.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Start a fresh manifest (the old file is kept as manifest.json.bak-<time>).",
)
@click.option("--no-push", is_flag=True, help="Do not push the manifest to the dashboard.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def init_manifest(
    root: str | None,
    cache_root: str | None,
    clusters: tuple[str, ...],
    force: bool,
    no_push: bool,
    as_json: bool,
) -> None:
    """Create the manifest, or add clusters to it (registry siblings are added too).

    Adding a second cluster to an install changes how it is used: commands that
    record results for this machine then need --cluster, and the output says so.
    """
    from rootstock.install.machine import served_clusters
    from rootstock.install.manifest import ensure_manifest

    layout = layout_from(root, None, cache_root)
    before = None if force or not layout.manifest_file.exists() else served_clusters(layout)
    result = ensure_manifest(layout, clusters, force=force)
    doc = result.to_dict()
    if as_json:
        emit_json(doc)
    else:
        served = ", ".join(doc["clusters"])
        added = [c for c in doc["clusters"] if before is not None and c not in before]
        verb = "created" if doc.get("created") else "updated"
        change = f": added {', '.join(added)}" if added else ""
        click.echo(f"{verb} {layout.manifest_file}{change}; clusters: {served}")
        if doc.get("backup"):
            click.echo(f"the previous file is kept as {doc['backup']}")
        if before is not None and len(before) <= 1 < len(doc["clusters"]):
            click.echo(
                f"note: this install now serves {len(doc['clusters'])} clusters, so `add`, "
                "`smoke-test`, `sync` (to verify) and `usage push` need --cluster NAME "
                f"({served}) to say which machine they run on"
            )
    from rootstock.cli.push_hooks import auto_push_dashboard, push_after

    push_after("manifest init", layout, auto_push_dashboard(no_push), doc["clusters"])


@manifest.command("push")
@root_options
@click.option("--json", "as_json", is_flag=True, help="Print each cluster's outcome as JSON.")
def push(root: str | None, cluster: str | None, cache_root: str | None, as_json: bool) -> None:
    """Push the manifest to the dashboard: one view per cluster this install serves.

    With --cluster, only that cluster's. Uses api_url, api_key and api_secret from
    config.toml; exit code 1 when any cluster's push failed.
    """
    from rootstock.install.machine import resolve_cluster
    from rootstock.ops.push import dashboard_settings, push_manifest

    dashboard = dashboard_settings()
    layout = layout_from(root, cluster, cache_root)
    clusters = [resolve_cluster(layout, cluster)] if cluster else None
    report = push_manifest(layout, clusters, dashboard)
    if as_json:
        emit_json(report.to_dict())
    else:
        for result in report.results:
            if result.ok:
                push_id = (result.response or {}).get("push_id")
                click.echo(
                    f"{result.cluster}: pushed to {report.api_url}"
                    + (f" (push {push_id})" if push_id is not None else "")
                )
    if not report.ok:
        raise report.error()
