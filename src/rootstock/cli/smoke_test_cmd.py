"""``rootstock smoke-test``."""

from __future__ import annotations

import sys

import click

from rootstock.cli.common import emit_json, layout_from, root_options, warn


@click.command("smoke-test")
@root_options
@click.option("--env", "env_name", help="Only this env's checkpoints.")
@click.option("--checkpoint", help="Only this checkpoint.")
@click.option("--device", default="cuda", show_default=True, help="cpu, cuda or xpu.")
@click.option(
    "--verify-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds to wait for each forward pass.",
)
@click.option(
    "--jobs",
    type=int,
    default=1,
    show_default=True,
    help="Verify N checkpoints at once (cuda: one GPU each, cuda:0..N-1).",
)
@click.option(
    "--push-every",
    type=int,
    metavar="N",
    help="Push a manifest snapshot to the dashboard after every N results.",
)
@click.option("--no-push", is_flag=True, help="Do not push the manifest to the dashboard.")
@click.option("--json", "as_json", is_flag=True, help="Print a per-checkpoint summary as JSON.")
def smoke_test(
    root,
    cluster,
    cache_root,
    env_name,
    checkpoint,
    device,
    verify_timeout,
    jobs,
    push_every,
    no_push,
    as_json,
):
    """Re-verify every fetched checkpoint; never downloads.

    Each result is written to manifest.json the moment it is known. Exit code 0
    only when everything tested passed.
    """
    from rootstock.ops.smoke_test import smoke_test as run_smoke_test

    if push_every:
        warn("--push-every: no dashboard is configured yet; results are only saved locally")
    layout = layout_from(root, cluster, cache_root)
    state = {"done": 0, "total": 0}

    def on_start(total: int) -> None:
        state["total"] = total
        if not as_json:
            click.echo(f"smoke-testing {total} checkpoint(s) on {device}", err=True)

    def on_result(result) -> None:
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

    report = run_smoke_test(
        layout,
        cluster=cluster,
        env=env_name,
        checkpoint=checkpoint,
        device=device,
        verify_timeout=verify_timeout,
        jobs=jobs,
        on_start=on_start,
        on_result=on_result,
    )
    if as_json:
        emit_json(report.to_dict())
    elif not report.results:
        click.echo("nothing to test: no fetched checkpoints (run `rootstock add ID` first)")
    if not report.ok:
        raise click.exceptions.Exit(1)
