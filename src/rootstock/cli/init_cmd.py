"""``rootstock init``: interactive on a terminal, flag-driven everywhere else."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rootstock.cli.common import emit_json, next_step
from rootstock.cli.options import CLUSTER, directory

_CACHE_EXPLAINER = (
    "Model weights can live on a different filesystem than the install\n"
    "itself — some clusters require it (the project filesystem may not\n"
    "support flock, or weights may belong on scratch)."
)


@click.command()
@click.option("--root", type=directory(), help="The install root to create.")
@click.option(
    "--cache-root",
    type=directory(),
    help="Put model weights here (another filesystem); skips the prompt.",
)
@click.option(
    "--cluster", type=CLUSTER, help="This machine's name (default: the host's short name)."
)
@click.option("--maintainer-name", help="Your name, recorded as the maintainer.")
@click.option("--maintainer-email", help="Your email, recorded as the maintainer.")
@click.option("--api-url", help="The dashboard URL that manifests are pushed to.")
@click.option("--api-key", help="Your dashboard API key.")
@click.option(
    "--api-secret-file",
    type=click.Path(dir_okay=False, exists=True),
    help="A file holding your dashboard API secret (keeps it out of shell history).",
)
@click.option(
    "--images/--no-images",
    default=None,
    help="Whether builds pack a squashfs image for node-local staging (default: on; "
    "docs/cold-start.md).",
)
@click.option(
    "--shared/--private",
    default=None,
    help="Whether other users use this root: only a shared one draws permission warnings "
    "(default: private under $HOME and the temp dirs, else asked; docs/permissions.md).",
)
@click.option("--force", is_flag=True, help="On a populated root, only add what is missing.")
@click.option("--yes", "-y", is_flag=True, help="Never prompt; flags and defaults decide.")
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
def init(
    root: str | None,
    cache_root: str | None,
    cluster: str | None,
    maintainer_name: str | None,
    maintainer_email: str | None,
    api_url: str | None,
    api_key: str | None,
    api_secret_file: str | None,
    images: bool | None,
    shared: bool | None,
    force: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """Create an install root and record it in your config.toml.

    On a terminal, init asks for whatever the flags leave open. Without one (batch
    jobs, CI) it never prompts.
    """
    from rootstock.errors import RootNotFound
    from rootstock.install.clusters import clusters_for_root
    from rootstock.install.config import load_config
    from rootstock.install.machine import first_root, suggest_cluster
    from rootstock.ops.init import InitRequest, init_root

    interactive = not yes and sys.stdin.isatty()
    load_config()  # a broken config.toml is refused before anything is created
    # The order every command resolves in; an unregistered cluster is no error
    # here, since init is how a new machine gets recorded.
    chosen = first_root(root, cluster)
    default_root = root or (str(chosen.root) if chosen else None)
    if root is None and interactive:
        root = click.prompt("Install root (on a shared filesystem)", default=default_root)
    root = root or default_root
    if not root:
        raise RootNotFound("no install root given", hint="pass --root PATH")
    root_path = Path(root).expanduser().absolute()
    registry = clusters_for_root(root_path)
    if cache_root is None and interactive:
        suggestion = next((str(c.cache_root) for c in registry if c.cache_root), None)
        click.echo(_CACHE_EXPLAINER)
        if click.confirm("Cache on a different filesystem?", default=suggestion is not None):
            cache_root = click.prompt("  Cache root", default=suggestion)
        else:
            # "No" declares the root itself, even where the registry has a legacy entry.
            cache_root = str(root_path)
    if shared is None and interactive and not (root_path / "layout.json").exists():
        shared = _ask_shared(root_path)
    if cluster is None and interactive:
        cluster = click.prompt("Cluster name", default=suggest_cluster(root_path), type=CLUSTER)
    secret = Path(api_secret_file).read_text().strip() if api_secret_file else None
    if (
        interactive
        and not (maintainer_name or api_key)
        and click.confirm(
            "Are you a maintainer of this install (pushes to the dashboard)?", default=False
        )
    ):
        maintainer_name = click.prompt("  Your name")
        maintainer_email = click.prompt("  Your email")
        api_url = click.prompt("  Dashboard API URL", default=api_url or "", show_default=False)
        api_key = click.prompt("  API key", default="", show_default=False) or None
        secret = (
            click.prompt("  API secret", hide_input=True, default="", show_default=False) or None
        )
    result = init_root(
        InitRequest(
            root=root_path,
            cache_root=Path(cache_root) if cache_root else None,
            cluster=cluster,
            maintainer_name=maintainer_name,
            maintainer_email=maintainer_email,
            api_url=api_url or None,
            api_key=api_key,
            api_secret=secret,
            force=force,
            images=images,
            shared=shared,
        )
    )
    if as_json:
        emit_json(result.to_dict())
        return
    click.echo(f"install root: {result.root}")
    click.echo(f"cache root:   {result.cache_root}")
    click.echo(f"cluster:      {result.cluster}")
    click.echo(f"config:       {result.config_file} (mode 0600)")
    click.echo(f"images:       {'on' if result.images else 'off'}")
    click.echo(f"shared:       {'yes' if result.shared else 'no (private)'}")
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    next_step("rootstock install environments/<model>.py")


def _ask_shared(root: Path) -> bool | None:
    """Ask whether others use ``root`` where no default fits; None leaves it to the default."""
    from rootstock.install.sharing import sharing_default

    if sharing_default(root).shared is not None:
        return None
    return click.confirm(
        "Will other users use this install (a shared root, checked for their access)?",
        default=True,
    )
