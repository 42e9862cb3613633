"""``rootstock add``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import click

from rootstock.cli.common import emit_json, layout_from, progress, root_options, warn
from rootstock.cli.options import (
    device_option,
    kwarg_option,
    timeout_seconds,
    verify_timeout_option,
)

if TYPE_CHECKING:
    from rootstock.install.layout import InstallLayout
    from rootstock.install.manifest import Checks, QuantityCheck


@click.command()
@click.argument("checkpoint", required=False)
@root_options
@click.option("--no-verify", is_flag=True, help="Only download (e.g. on a login node).")
@device_option("Device to verify on: cpu, cuda, cuda:N or xpu.")
@kwarg_option(
    "Keyword for setup() (JSON-decoded, else a string). Repeatable. "
    "Without any, VERIFY_KWARGS applies.",
    metavar="K=V",
)
@verify_timeout_option
@click.option(
    "--download-timeout",
    type=timeout_seconds(),
    default=3600.0,
    show_default=True,
    help="Seconds the download may take before it is stopped.",
)
@click.option("--force", is_flag=True, help="Download again even if already fetched.")
@click.option(
    "--accept-drift", is_flag=True, help="Accept this result as the new reference fingerprint."
)
@click.option("--no-push", is_flag=True, help="Do not push the manifest to the dashboard.")
@click.option("--no-perm-check", is_flag=True, help="Skip the up-front permission check.")
@click.option("--list", "list_only", is_flag=True, help="List addable checkpoint ids and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def add(
    checkpoint: str | None,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    no_verify: bool,
    device: str,
    kwarg_pairs: tuple[str, ...],
    verify_timeout: float,
    download_timeout: float,
    force: bool,
    accept_drift: bool,
    no_push: bool,
    no_perm_check: bool,
    list_only: bool,
    as_json: bool,
) -> None:
    """Download a checkpoint's weights and verify them with one forward pass.

    Download runs on the CPU with the network; verification runs on --device,
    offline. Re-running skips the download and verifies again.
    """
    from rootstock.cli.kwargs import parse_kwargs
    from rootstock.errors import UsageError
    from rootstock.ops.add import add as run_add

    # Before the root is even resolved: a bad --kwarg is the first thing reported.
    setup_kwargs = parse_kwargs(kwarg_pairs)
    layout = layout_from(root, cluster, cache_root)
    if list_only:
        _list_addable(layout, cluster, as_json)
        return
    if not checkpoint:
        raise UsageError("missing CHECKPOINT", hint="`rootstock add --list` shows the ids")
    if not no_perm_check:
        from rootstock.cli.perms_cmd import warn_about_perms

        warn_about_perms(layout)
    with progress(enabled=not as_json) as step:
        result = run_add(
            layout,
            checkpoint,
            cluster=cluster,
            device=device,
            kwargs=setup_kwargs,
            verify=not no_verify,
            verify_timeout=verify_timeout,
            download_timeout=download_timeout,
            force=force,
            accept_drift=accept_drift,
            step=step,
        )
    doc = result.to_dict()
    if as_json:
        emit_json(doc)
    else:
        line = f"{checkpoint} ({result.env}) on {result.cluster}: {doc['state']}"
        if doc["seconds"] is not None:
            line += f" on {doc['device']} in {doc['seconds']:.1f} s"
        click.echo(line)
        if doc["checks"]:
            click.echo(f"  physics checks: {describe_checks(doc['checks'])}")
        if doc["message"]:
            click.echo(f"  {doc['message']}", err=True)
    from rootstock.cli.push_hooks import auto_push_dashboard, push_after

    push_after("add", layout, auto_push_dashboard(no_push), [result.cluster])
    if not result.ok:
        raise click.exceptions.Exit(1)


def describe_checks(checks: Checks) -> str:
    """``forces 1.000, stress 0.999 (model / energy derivative, float64 rule)``."""
    parts: list[str] = []
    quantities: tuple[Literal["forces", "stress"], ...] = ("forces", "stress")
    for quantity in quantities:
        check: QuantityCheck = checks.get(quantity) or {}
        ratio = check.get("ratio")
        if check.get("mode") == "n/a":
            parts.append(f"{quantity} n/a")
        elif isinstance(ratio, int | float):
            mode = "" if check.get("mode") == "gradient" else f" ({check.get('mode')})"
            mark = "" if check.get("ok") else " FAILED"
            shown = f"{ratio:.4g}" if abs(ratio) >= 10 else f"{ratio:.3f}"
            parts.append(f"{quantity} {shown}{mode}{mark}")
    return f"{', '.join(parts)} (model / energy derivative, {checks.get('dtype')} rule)"


def _list_addable(layout: InstallLayout, cluster: str | None, as_json: bool) -> None:
    from rootstock.install.envfile import is_custom_id
    from rootstock.install.envs import envs_on_cluster, load_installed_envs

    envs, warnings = load_installed_envs(layout)
    if not as_json:
        for line in warnings:
            warn(line)
    rows = [
        {"env": e.name, "checkpoint": c}
        for e in envs_on_cluster(envs, cluster)
        for c in e.checkpoints
        if not is_custom_id(c)
    ]
    if as_json:
        emit_json(rows)
        return
    for row in rows:
        click.echo(f"{row['checkpoint']}\t({row['env']})")
