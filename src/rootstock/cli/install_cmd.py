"""``rootstock install``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from rootstock.cli.common import emit_json, layout_from, progress, root_options, warn

if TYPE_CHECKING:
    from rootstock.install.dry_run import InstallPlan
    from rootstock.install.layout import InstallLayout


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
@click.option(
    "--image/--no-image",
    default=None,
    help="Pack a squashfs image of the build for node-local staging "
    "(default: the root's setting, on unless `init --no-images`).",
)
@click.option("--no-push", is_flag=True, help="Do not push the manifest to the dashboard.")
@click.option("--no-perm-check", is_flag=True, help="Skip the up-front permission check.")
@click.option("-v", "--verbose", is_flag=True, help="Stream uv's output.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Lint and show what would be built; never runs uv, never writes to the root.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def install(
    target: str,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    force: bool,
    upgrade: bool,
    python: str | None,
    find_links: tuple[str, ...],
    constraints: tuple[str, ...],
    image: bool | None,
    no_push: bool,
    no_perm_check: bool,
    verbose: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Build env files into isolated envs under {root}/envs/.

    TARGET is an env file, a directory of *.py env files, or the name of an
    already registered env (with --force, to rebuild it). --dry-run only shows
    what would happen (exit code 1 when an env would fail).
    """
    if not target.strip():
        from rootstock.errors import UsageError

        # An empty TARGET would silently mean the current directory.
        raise UsageError(
            "TARGET cannot be empty", hint="pass an env file, a directory, or an env name"
        )
    if dry_run:
        _dry_run(target, root, cluster, cache_root, force, upgrade, python, as_json)
        return
    from rootstock.install.build import BuildOptions
    from rootstock.ops.install import install as run_install

    layout = layout_from(root, cluster, cache_root)
    check_named_env(layout, target)
    if not no_perm_check:
        from rootstock.cli.perms_cmd import warn_about_perms

        warn_about_perms(layout)
    options = BuildOptions(
        upgrade=upgrade,
        find_links=list(find_links),
        constraints=list(constraints),
        verbose=verbose,
        image=image,
    )
    with progress(enabled=not as_json) as step:
        outcomes = run_install(
            layout, target, force=force or upgrade, options=options, python=python, step=step
        )
    if as_json:
        emit_json([o.to_dict() for o in outcomes])
    else:
        for outcome in outcomes:
            for warning in outcome.warnings:
                warn(f"{outcome.name}: {warning}")
            # The reported notes (the interpreter's) were said as they happened.
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


def check_named_env(layout: InstallLayout, target: str) -> None:
    """TARGET as an env name (not a path): a typo is a usage error with close matches."""
    import os
    from pathlib import Path

    from rootstock.install.envs import require_registered_env

    path = Path(target).expanduser()
    if path.exists() or path.suffix == ".py" or os.sep in target:
        return  # a path: ops.install reports a missing file as such
    require_registered_env(layout, target)


def _dry_run(
    target: str,
    root: str | None,
    cluster: str | None,
    cache_root: str | None,
    force: bool,
    upgrade: bool,
    python: str | None,
    as_json: bool,
) -> None:
    """Plan the install and render it; exit 1 when any env would fail."""
    from rootstock.errors import RootNotFound
    from rootstock.ops.install import plan_install

    layout: InstallLayout | None
    try:
        layout = layout_from(root, cluster, cache_root, must_exist=False)
    except RootNotFound:
        layout = None  # lint only; the plan says so
    if layout is not None:
        check_named_env(layout, target)
    plan = plan_install(
        layout, target, force=force, upgrade=upgrade, python=python, cluster=cluster
    )
    if as_json:
        emit_json(plan.to_dict())
    else:
        _render_plan(plan)
    if not plan.ok:
        raise click.exceptions.Exit(1)


def _render_plan(plan: InstallPlan) -> None:
    """The human form of an install plan: one block per env, problems on stderr."""
    where = f"root {plan.root}" if plan.root else "no install root"
    click.echo(f"dry run: nothing is built or written ({where})")
    for note in plan.notes:
        click.echo(f"note: {note}")
    for env in plan.envs:
        click.echo("")
        click.echo(f"{env.name}: would {_ACTION_WORDS[env.action]} ({env.path})")
        click.echo(f"  {env.reason}")
        rows = [
            ("requires-python", env.requires_python or "(any)"),
            ("dependencies", ", ".join(env.dependencies) or "(none)"),
            ("checkpoints", ", ".join(env.checkpoints) or "(none)"),
        ]
        if env.clusters:
            rows.append(("clusters", ", ".join(env.clusters) + " (a variant: it wins there)"))
        rows.extend(_tool_uv_rows(env.tool_uv))
        if env.shadows:
            by_env: dict[str, list[str]] = {}
            for shadow in env.shadows:
                by_env.setdefault(shadow.env, []).append(shadow.checkpoint)
            rows.extend(
                ("shadows", f"{', '.join(ids)} of {name!r}") for name, ids in by_env.items()
            )
        if env.resolution == "lockfile":
            rows.append(("resolution", f"from the recorded lockfile {env.lockfile}"))
        elif env.resolution:
            rows.append(("resolution", env.resolution))
        if env.interpreter:
            rows.append(("interpreter", env.interpreter))
        for label, value in rows:
            click.echo(f"  {label:<16} {value}")
        for problem in env.problems:
            click.echo(f"error: {env.name}: {problem}", err=True)
        for warning in env.warnings:
            warn(f"{env.name}: {warning}")
    counts = {action: sum(e.action == action for e in plan.envs) for action in _ACTION_WORDS}
    summary = ", ".join(f"{n} {action}" for action, n in counts.items() if n)
    click.echo("")
    click.echo(f"plan: {summary or 'nothing to do'}")


_ACTION_WORDS = {
    "build": "build",
    "rebuild": "rebuild",
    "unchanged": "skip (unchanged)",
    "blocked": "fail",
}


def _tool_uv_rows(tool_uv: dict[str, Any]) -> list[tuple[str, str]]:
    """``[tool.uv]`` settings as label/value rows: indexes and sources spelled out."""
    import json

    rows: list[tuple[str, str]] = []
    for index in tool_uv.get("index") or []:
        if isinstance(index, dict):
            flags = [k for k in ("explicit", "default") if index.get(k) is True]
            text = f"{index.get('name', '(unnamed)')} = {index.get('url')}"
            rows.append(("uv index", text + (f" ({', '.join(flags)})" if flags else "")))
    for package, source in (tool_uv.get("sources") or {}).items():
        entries = source if isinstance(source, list) else [source]
        for entry in entries:
            if isinstance(entry, dict):
                text = ", ".join(f"{k} {v}" for k, v in entry.items())
            else:
                text = json.dumps(entry)
            rows.append(("uv source", f"{package} <- {text}"))
    for key, value in tool_uv.items():
        if key not in ("index", "sources"):
            rows.append((f"uv {key}", json.dumps(value, sort_keys=True)))
    return rows
