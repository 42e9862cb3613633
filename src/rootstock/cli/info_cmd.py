"""``rootstock info CHECKPOINT``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from rootstock.cli.common import emit_json, layout_from, root_options

if TYPE_CHECKING:
    from rootstock.ops.info import CheckpointReport

# The CHECKPOINT_INFO fields in the order they are shown, with their labels.
_INFO_LABELS = {
    "summary": "summary",
    "licence": "licence",
    "gated": "gated",
    "source": "source",
    "citation": "citation",
    "training_data": "training data",
}


@click.command()
@click.argument("checkpoint")
@root_options
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def info(
    checkpoint: str, root: str | None, cluster: str | None, cache_root: str | None, as_json: bool
) -> None:
    """Show what a checkpoint is, its env and build, its files and its verifications.

    The env file's CHECKPOINT_INFO (licence, gating, source, citation, training
    data), the build that serves it (build id, the versions its lockfile resolved,
    its image), the weight files with their sizes and hashes, and the latest
    verification per cluster and device with the physics checks' ratios.
    """
    from rootstock.ops.info import checkpoint_report

    report = checkpoint_report(layout_from(root, cluster, cache_root), checkpoint, cluster)
    if as_json:
        emit_json(report)
        return
    for line in render_report(report):
        click.echo(line)


def render_report(report: CheckpointReport) -> list[str]:
    """The human form of ``info``: one field a line, grouped under headings."""
    from rootstock.cli.add_cmd import describe_checks
    from rootstock.cli.status_cmd import describe_size

    lines = [f"{report['checkpoint']} (env {report['env']})"]
    if report["custom"]:
        lines.append("  takes user-supplied weights (weights=PATH)")
    elif report["upstream"]:
        lines.append(f"  upstream: {report['upstream']}")
    info: dict[str, Any] = dict(report["info"])
    shown = {key: info[key] for key in _INFO_LABELS if key in info}
    for key, value in shown.items():
        text = "not gated" if key == "gated" and value is None else value
        lines.append(f"  {_INFO_LABELS[key] + ':':<15}{text}")
    if not shown:
        lines.append("  (its env file declares no CHECKPOINT_INFO)")
    build = report["build"]
    lines.append("build:")
    if build is None:
        lines.append("  (no build metadata)")
    else:
        lines.append(f"  {'build id:':<15}{build['build_id']} (built {build['built_at']})")
        lines.append(f"  {'python:':<15}{build['python'] or '-'}")
        packages = ", ".join(f"{n} {v or '-'}" for n, v in build["packages"].items())
        lines.append(f"  {'packages:':<15}{packages or '-'}")
        image = build["image"]
        lines.append(
            f"  {'image:':<15}"
            + (
                f"{image['file']} ({describe_size(image['size'])}, sha256 {image['sha256']})"
                if image
                else "none"
            )
        )
    lines.append(f"weights: fetched {report['fetched_at']}" if report["fetched_at"] else "weights:")
    files = report["files"]
    if files is None:
        lines.append("  (no files recorded)")
    elif not files:
        lines.append("  (none: the download brought no files)")
    for row in files or []:
        size = describe_size(row["size"]) if row["size"] is not None else "size unknown"
        digest = f"sha256 {row['sha256']}" if row["sha256"] else "not hashed"
        missing = "" if row["present"] else " MISSING"
        lines.append(f"  {row['path']}  {size}  {digest}{missing}")
    lines.append("verifications:")
    if not report["verifications"]:
        lines.append("  (none)")
    for record in report["verifications"]:
        where = f"{record['cluster']}/{record['device_kind']}"
        lines.append(
            f"  {where}: {record['state']} on {record['device'] or '-'} at {record['at'] or '-'}"
            + (f" (build {record['build_id']})" if record["build_id"] else "")
        )
        if record["message"]:
            lines.append(f"    {record['message']}")
        if record["checks"]:
            lines.append(f"    physics checks: {describe_checks(record['checks'])}")
    return lines
