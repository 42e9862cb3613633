"""``rootstock install``."""

from __future__ import annotations

import click

from rootstock.cli.common import emit_json, layout_from, progress, root_options


@click.command()
@click.argument("target")
@root_options
@click.option("--force", is_flag=True, help="Rebuild an installed env (from its lockfile).")
@click.option(
    "--upgrade", is_flag=True, help="Re-resolve to the newest allowed versions (implies --force)."
)
@click.option(
    "--python",
    "python",
    metavar="PATH|VERSION",
    help="Build on this interpreter instead of a uv-managed one.",
)
@click.option(
    "--find-links",
    multiple=True,
    metavar="DIR",
    help="Also look for wheels in DIR (a local wheelhouse). Repeatable.",
)
@click.option(
    "--constraint",
    "constraints",
    multiple=True,
    metavar="FILE",
    help="Constrain versions with FILE (as uv's -c). $UV_CONSTRAINT also works.",
)
@click.option("--no-push", is_flag=True, help="Do not push the manifest to the dashboard.")
@click.option("--no-perm-check", is_flag=True, help="Skip the up-front permission check.")
@click.option("-v", "--verbose", is_flag=True, help="Stream uv's output.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def install(
    target,
    root,
    cluster,
    cache_root,
    force,
    upgrade,
    python,
    find_links,
    constraints,
    no_push,
    no_perm_check,
    verbose,
    as_json,
):
    """Build env files into isolated envs under {root}/envs/.

    TARGET is an env file, a directory of *.py env files, or the name of an
    already registered env (with --force, to rebuild it).
    """
    from rootstock.install.build import BuildOptions
    from rootstock.ops.install import install as run_install

    layout = layout_from(root, cluster, cache_root)
    if not no_perm_check:
        from rootstock.cli.perms_cmd import warn_about_perms

        warn_about_perms(layout)
    options = BuildOptions(
        upgrade=upgrade, find_links=list(find_links), constraints=list(constraints), verbose=verbose
    )
    with progress(enabled=not as_json) as step:
        outcomes = run_install(
            layout, target, force=force or upgrade, options=options, python=python, step=step
        )
    if as_json:
        emit_json([o.to_dict() for o in outcomes])
    else:
        for outcome in outcomes:
            for note in outcome.notes:
                click.echo(f"{outcome.name}: {note}", err=True)
            if outcome.status == "failed":
                click.echo(f"error: {outcome.name}: {outcome.error}", err=True)
            elif outcome.status == "built":
                versions = outcome.versions or {}
                click.echo(
                    f"installed {outcome.name} (Python {versions.get('python')}) "
                    f"-> {outcome.env_dir}"
                )
    if any(o.status == "built" for o in outcomes):
        from rootstock.cli.push_hooks import auto_push_dashboard, push_after

        # Builds are shared by every cluster of the install: push each one's view.
        push_after("install", layout, auto_push_dashboard(no_push))
    if any(o.status == "failed" for o in outcomes):
        raise click.exceptions.Exit(1)
