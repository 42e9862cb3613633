"""``rootstock benchmark``."""

from __future__ import annotations

from typing import Any

import click

from rootstock.cli.common import emit_json, progress, root_options
from rootstock.cli.options import (
    CALLS,
    DEVICE,
    SETUP_KWARGS,
    WARMUP,
    timeout_seconds,
    weights_option,
)


@click.command()
@click.argument("checkpoints", nargs=-1, required=True, metavar="CHECKPOINT...")
@click.option(
    "--device",
    type=DEVICE,
    default="cuda",
    show_default=True,
    help="Passed to setup(): cpu, cuda, cuda:N or xpu.",
)
@click.option(
    "--system",
    default="Cu:256",
    show_default=True,
    metavar="El:N|MOLECULE",
    help="El:N: El's cubic reference crystal with at least N atoms; "
    "or an ASE molecule name (H2O), not periodic.",
)
@click.option(
    "--calls",
    type=CALLS,
    default=100,
    show_default=True,
    help="Timed calls per run.",
)
@click.option(
    "--warmup",
    type=WARMUP,
    default=10,
    show_default=True,
    help="Untimed calls after the first, per run.",
)
@click.option(
    "--setup-kwargs",
    type=SETUP_KWARGS,
    metavar="JSON",
    help="A JSON object of keywords for setup() (default: the env's VERIFY_KWARGS).",
)
@weights_option
@click.option(
    "--timeout",
    type=timeout_seconds(),
    default=1800.0,
    show_default=True,
    help="Seconds for each calculator step, and for the whole in-env run.",
)
@root_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def benchmark(
    checkpoints: tuple[str, ...],
    device: str,
    system: str,
    calls: int,
    warmup: int,
    setup_kwargs: dict[str, Any] | None,
    weights: str | None,
    timeout: float,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    as_json: bool,
) -> None:
    """Time the worker boundary: each CHECKPOINT through RootstockCalculator and in its env.

    The same seeded random walk (every atom moves 0.005 Å per call, seed 42) runs
    twice: through RootstockCalculator, and in the env's own Python calling setup()
    directly. Reports median, p95 and min ms per call for each, the overhead, the
    start-up (first call) and how far the two runs' energies differ.
    """
    from rootstock.ops.benchmark import benchmark as run_benchmark
    from rootstock.runtime import WorkerOptions

    options = WorkerOptions(
        root, cluster, cache_root, device=device, setup_kwargs=setup_kwargs, weights=weights
    )
    with progress(enabled=not as_json) as step:
        report = run_benchmark(
            list(checkpoints),
            options,
            system=system,
            calls=calls,
            warmup=warmup,
            timeout=timeout,
            step=step,
        )
    doc = report.to_dict()
    if as_json:
        emit_json(doc)
        return
    render(doc)


def render(doc: dict) -> None:
    """The human table: one row per run, then the overhead of each checkpoint."""
    from rootstock.cli.common import console, print_table, table

    system, walk = doc["system"], doc["walk"]
    click.echo(f"system  {_describe(system)}")
    click.echo(
        f"walk    seed {walk['seed']}, {walk['step']} Å steps: 1 start-up + "
        f"{walk['warmup']} warm-up + {walk['calls']} timed calls per run, on {doc['device']}\n"
    )
    columns = ["checkpoint", "run", "median ms", "p95 ms", "min ms", "start-up s"]
    tab = table(None, columns, whole=("checkpoint",))
    for column in tab.columns[2:]:
        column.justify = "right"
    for result in doc["results"]:
        for label, key in (("calculator", "calculator"), ("in env", "in_env")):
            run = result[key]
            tab.add_row(
                result["checkpoint"] if key == "calculator" else "",
                label,
                f"{run['median_ms']:.3f}",
                f"{run['p95_ms']:.3f}",
                f"{run['min_ms']:.3f}",
                f"{run['startup_s']:.2f}",
            )
    print_table(console(), tab)
    click.echo()
    for result in doc["results"]:
        pct = result["overhead_pct"]
        share = f" ({pct:+.1f}%)" if pct is not None else ""
        click.echo(
            f"{result['checkpoint']} ({result['env']}): overhead {result['overhead_ms']:+.3f} ms "
            f"per call{share}; energies agree to {result['max_energy_diff']:.2e} eV, "
            f"last forces to {result['max_force_diff']:.2e} eV/Å"
        )


def _describe(system: dict) -> str:
    if system["kind"] == "bulk":
        n = system["repeat"]
        return (
            f"{system['spec']}: {system['formula']}, {system['structure']} "
            f"a={system['lattice_constant']:g} Å, {n}x{n}x{n} cubic cells, "
            f"{system['natoms']} atoms, periodic"
        )
    return (
        f"{system['spec']}: {system['formula']}, {system['natoms']} atoms, not periodic (no stress)"
    )
