"""``rootstock serve``: serve a checkpoint to an external i-PI server."""

from __future__ import annotations

import click

from rootstock.cli.common import root_options
from rootstock.cli.kwargs import parse_kwargs
from rootstock.cli.options import setup_options, timeout_seconds


@click.command()
@click.argument("checkpoint")
@click.option(
    "--socket",
    "socket_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Unix socket the server binds (ASE and i-PI use /tmp/ipi_NAME).",
)
@setup_options
@click.option(
    "--structure",
    type=click.Path(exists=True, dir_okay=False),
    help="ASE-readable file with the species and PBC. Required: standard i-PI servers "
    "send no species (serve refuses to start without it, exit code 2).",
)
@click.option(
    "--connect-timeout",
    type=timeout_seconds(zero_means="retry forever"),
    default=600.0,
    show_default=True,
    help="Seconds to keep retrying until the server is up (0: forever).",
)
@click.option(
    "--pool",
    is_flag=True,
    help="Compute through your pooled worker for CHECKPOINT on this node, shared with "
    "other serve processes and calculators (pool=True); their calls are merged into one "
    "model batch when the env has an evaluate_batch hook.",
)
@root_options
def serve(
    checkpoint: str,
    socket_path: str,
    device: str,
    kwarg_pairs: tuple[str, ...],
    weights: str | None,
    structure: str | None,
    connect_timeout: float,
    pool: bool,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
) -> None:
    """Serve CHECKPOINT to an i-PI server (ASE's SocketIOCalculator, i-PI, ...).

    The worker connects to --socket as a standard i-PI client, retrying until the
    server is up, and runs until the server sends EXIT or closes the connection.
    A standard server sends no species: --structure FILE supplies them.
    i-PI's batched mode (batch_size in its ffsocket, i-PI 3.3 or later) needs no
    option: the batch size comes with i-PI's INIT.
    """
    from rootstock.ops.serve import serve as run_serve
    from rootstock.runtime import WorkerOptions

    setup_kwargs = parse_kwargs(kwarg_pairs) or {}
    options = WorkerOptions(
        root, cluster, cache_root, device=device, setup_kwargs=setup_kwargs, weights=weights
    )
    result = run_serve(
        checkpoint,
        socket_path,
        options,
        structure=structure,
        connect_timeout=connect_timeout,
        pool=pool,
    )
    click.echo(f"served {result.checkpoint} (env {result.env_name}) on {result.socket}", err=True)
