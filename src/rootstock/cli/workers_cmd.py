"""``rootstock workers``: the user's pooled workers on this node (start, list, stop)."""

from __future__ import annotations

from typing import Any

import click

from rootstock.cli.common import console, emit_json, print_table, progress, root_options, table
from rootstock.cli.options import SETUP_KWARGS, device_option, timeout_seconds, weights_option


@click.group()
def workers() -> None:
    """Pooled workers: warm models that calculators in other processes attach to.

    A calculator made with pool=True (or with ROOTSTOCK_POOL=1) attaches to the
    pooled worker for its checkpoint, device and setup keywords, starting one if
    there is none; it stays up until --idle-timeout seconds pass with no client.
    """


@workers.command("start")
@click.argument("checkpoint")
@device_option()
@click.option(
    "--setup-kwargs",
    type=SETUP_KWARGS,
    metavar="JSON",
    help="A JSON object of keywords for setup(), as RootstockCalculator's setup_kwargs.",
)
@weights_option
@click.option(
    "--idle-timeout",
    type=timeout_seconds(),
    default=600.0,
    show_default=True,
    help="Seconds the worker stays up with no client.",
)
@click.option(
    "--timeout",
    type=timeout_seconds(),
    default=1800.0,
    show_default=True,
    help="Seconds to wait for the model to load.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the worker's record as JSON.")
@root_options
def start(
    checkpoint: str,
    device: str,
    setup_kwargs: dict[str, Any] | None,
    weights: str | None,
    idle_timeout: float,
    timeout: float,
    as_json: bool,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
) -> None:
    """Start the pooled worker for CHECKPOINT (or find it running); print its id.

    The command returns once the model is loaded; calculators made with the same
    checkpoint, device and setup keywords and pool=True then attach at once.
    """
    from rootstock.ops.workers import start_worker
    from rootstock.runtime import WorkerOptions

    options = WorkerOptions(
        root, cluster, cache_root, device=device, setup_kwargs=setup_kwargs, weights=weights
    )
    with progress() as step:
        step(f"starting the pooled worker for {checkpoint} (or finding it)")
        worker = start_worker(checkpoint, options, idle_timeout=idle_timeout, timeout=timeout)
        step(f"worker {worker.id} is ready (worker pid {worker.worker_pid})")
    if as_json:
        emit_json(worker.to_json())
    else:
        click.echo(worker.id)


@workers.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the workers as JSON.")
def list_workers(as_json: bool) -> None:
    """List your pooled workers on this node."""
    from rootstock.ops.workers import WORKERS_SCHEMA
    from rootstock.ops.workers import list_workers as run_list

    found = run_list()
    if as_json:
        emit_json({"schema": WORKERS_SCHEMA, "workers": [w.to_json() for w in found]})
        return
    if not found:
        click.echo("no pooled workers are running")
        return
    columns = ["id", "checkpoint", "env", "device", "daemon", "worker", "clients", "started"]
    tab = table(
        None, [*columns, "idle timeout", "stale", "merged"], whole=("id", "checkpoint", "env")
    )
    for w in found:
        tab.add_row(
            w.id,
            w.checkpoint,
            w.env,
            w.device,
            str(w.daemon_pid),
            str(w.worker_pid),
            str(w.clients),
            w.started,
            f"{w.idle_timeout:g} s",
            "stale" if w.stale else "-",
            _merged(w.stats),
        )
    print_table(console(), tab)


@workers.command("stop")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@click.option("--all", "all_workers", is_flag=True, help="Stop every pooled worker of yours.")
@click.option("--json", "as_json", is_flag=True, help="Print the stopped workers as JSON.")
def stop(ids: tuple[str, ...], all_workers: bool, as_json: bool) -> None:
    """Stop pooled workers by ID (a unique prefix will do), or all of them with --all.

    Their clients' next calls start a fresh pooled worker.
    """
    from rootstock.errors import UsageError
    from rootstock.ops.workers import WORKERS_SCHEMA, stop_workers

    if all_workers and ids:
        raise UsageError("give IDs or --all, not both")
    stopped = stop_workers(list(ids), all_workers=all_workers)
    if as_json:
        emit_json({"schema": WORKERS_SCHEMA, "stopped": [w.to_json() for w in stopped]})
        return
    for w in stopped:
        click.echo(f"stopped {w.id} ({w.checkpoint}, daemon pid {w.daemon_pid})", err=True)
    if not stopped:
        click.echo("no pooled workers were running", err=True)


def _merged(stats: dict) -> str:
    """``3/120 (mean 2.5)``: merged batches of all turns at the worker, and the mean
    single calls per turn; ``-`` before the first."""
    batches, merged, mean = (
        stats.get("batches"),
        stats.get("merged_batches"),
        stats.get("batch_size_mean"),
    )
    if not batches or mean is None:
        return "-"
    return f"{merged}/{batches} (mean {mean:.1f})"
