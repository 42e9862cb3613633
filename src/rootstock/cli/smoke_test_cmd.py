"""``rootstock smoke-test``."""

from __future__ import annotations

import sys

import click

from rootstock.cli.common import emit_json, layout_from, root_options
from rootstock.cli.options import DEVICE, JOBS, push_every_option, verify_timeout_option


@click.command("smoke-test")
@root_options
@click.option("--env", "env_name", help="Only this env's checkpoints.")
@click.option("--checkpoint", help="Only this checkpoint.")
@click.option(
    "--device", type=DEVICE, default="cuda", show_default=True, help="cpu, cuda[:N] or xpu[:N]."
)
@verify_timeout_option
@click.option(
    "--jobs",
    type=JOBS,
    default=1,
    show_default=True,
    help="Verify N checkpoints at once (cuda: one GPU each, cuda:0..N-1).",
)
@click.option(
    "--rehash",
    is_flag=True,
    help="Re-hash every weight file before its forward pass (default: only files "
    "whose size or mtime changed since add).",
)
@push_every_option
@click.option("--no-push", is_flag=True, help="Do not push the manifest to the dashboard.")
@click.option("--json", "as_json", is_flag=True, help="Print a per-checkpoint summary as JSON.")
def smoke_test(
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    env_name: str | None,
    checkpoint: str | None,
    device: str,
    verify_timeout: float,
    jobs: int,
    rehash: bool,
    push_every: int | None,
    no_push: bool,
    as_json: bool,
) -> None:
    """Re-verify every fetched checkpoint; never downloads.

    Each result is written to manifest.json the moment it is known. Exit code 0
    only when everything tested passed. A weight file that changed since `add`
    fails its checkpoint as tampered, and its model is not run.
    """
    from rootstock.cli.push_hooks import auto_push_dashboard, push_after, show_notice
    from rootstock.ops.push_policy import snapshot_pushes
    from rootstock.ops.smoke import SmokeResult
    from rootstock.ops.smoke import smoke_test as run_smoke_test

    layout = layout_from(root, cluster, cache_root)
    from rootstock.ops.checkpoints import check_selection

    # Before the dashboard is even looked up: a typo is the first thing reported.
    check_selection(layout, cluster, env_name, checkpoint)
    dashboard = auto_push_dashboard(no_push, asked_by="--push-every" if push_every else None)
    machine = None
    if dashboard is not None:
        from rootstock.install.machine import resolve_cluster

        machine = resolve_cluster(layout, cluster)
    state = {"done": 0, "total": 0}

    def on_start(total: int) -> None:
        state["total"] = total
        if not as_json:
            click.echo(f"smoke-testing {total} checkpoint(s) on {device}", err=True)

    def on_result(result: SmokeResult) -> None:
        state["done"] += 1
        if as_json:
            return
        mark = "ok  " if result.passed else "FAIL"
        line = (
            f"[{state['done']}/{state['total']}] {mark} {result.checkpoint} ({result.env}) "
            f"{result.state} on {result.device} in {result.seconds:.1f} s"
        )
        if result.message and not result.passed:
            line += f": {result.message}"
        click.echo(line)
        sys.stdout.flush()

    with snapshot_pushes(layout, dashboard, machine, push_every, show_notice) as snapshots:
        report = run_smoke_test(
            layout,
            cluster=cluster,
            env=env_name,
            checkpoint=checkpoint,
            device=device,
            verify_timeout=verify_timeout,
            jobs=jobs,
            rehash=rehash,
            on_start=on_start,
            on_result=on_result,
            snapshot_every=push_every if snapshots else None,
            on_snapshot=snapshots.on_snapshot if snapshots else lambda _n: None,
        )
        deadline = snapshots.finish() if snapshots else None
    # The final push, after the last result (each result is already in manifest.json).
    push_after("smoke-test", layout, dashboard, [machine] if machine else None, deadline)
    if as_json:
        emit_json(report.to_dict())
    elif not report.results:
        click.echo("nothing to test: no fetched checkpoints (run `rootstock add ID` first)")
    if not report.ok:
        raise click.exceptions.Exit(1)
