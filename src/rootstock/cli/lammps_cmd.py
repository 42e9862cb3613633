"""``rootstock lammps``: run a LAMMPS input script with a checkpoint as its forces."""

from __future__ import annotations

from pathlib import Path

import click

from rootstock.cli.common import root_options
from rootstock.cli.kwargs import parse_kwargs
from rootstock.cli.options import setup_options


@click.command()
@click.argument("in_file", metavar="IN_FILE", type=click.Path(exists=True, dir_okay=False))
@click.option("--checkpoint", required=True, help="The checkpoint id that supplies the forces.")
@setup_options
@click.option(
    "--log",
    "log_file",
    default="log.lammps",
    show_default=True,
    help="LAMMPS's log file ('none': no log).",
)
@click.option("--quiet", is_flag=True, help="No LAMMPS screen output (the log is still written).")
@root_options
def lammps(
    in_file: str,
    checkpoint: str,
    device: str,
    kwarg_pairs: tuple[str, ...],
    weights: str | None,
    log_file: str,
    quiet: bool,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
) -> None:
    """Run the LAMMPS input IN_FILE with CHECKPOINT as a fix external.

    IN_FILE is an ordinary LAMMPS input (units metal, one MPI rank) with one added
    line after the box and atoms exist:

        #rootstock: fix ID all elements Cu Ag

    which becomes ``fix ID all external pf/callback 1 1`` answered by the model
    (one element per atom type, in type order), with
    ``fix_modify ID energy yes virial yes``. Paths in the input are relative to
    the current directory, as with ``lmp -in``.
    """
    from rootstock.integrations.lammps import run_input
    from rootstock.runtime import RootstockCalculator

    text = Path(in_file).read_text()
    cmdargs = ["-nocite", "-log", log_file]
    if quiet:
        cmdargs += ["-screen", "none"]
    with RootstockCalculator(
        checkpoint,
        root=root,
        cluster=cluster,
        cache_root=cache_root,
        device=device,
        setup_kwargs=parse_kwargs(kwarg_pairs) or None,
        weights=weights,
    ) as calc:
        calls = run_input(text, calc, cmdargs, source=in_file)
    click.echo(f"{calls} force evaluations by {checkpoint} in {in_file}", err=True)
