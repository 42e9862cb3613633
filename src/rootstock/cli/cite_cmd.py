"""``rootstock cite CHECKPOINT...``."""

from __future__ import annotations

import click

from rootstock.cli.common import emit_json, layout_from, root_options


@click.command()
@click.argument("checkpoints", metavar="CHECKPOINT...", nargs=-1, required=True)
@root_options
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def cite(
    checkpoints: tuple[str, ...],
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    as_json: bool,
) -> None:
    """Print BibTeX for the checkpoints' papers, and for Rootstock itself.

    Each entry comes from the env file's CHECKPOINT_INFO citation (a DOI or an
    arXiv id), with no network: the identifier and its URL, which a reference
    manager completes. A checkpoint without a citation gets a % comment line.
    """
    from rootstock.ops.cite import cite as cite_checkpoints

    entries = cite_checkpoints(layout_from(root, cluster, cache_root), list(checkpoints), cluster)
    if as_json:
        emit_json(entries)
        return
    click.echo("\n\n".join(entry["bibtex"] for entry in entries))
