"""``setup-perms`` and ``check-perms``: plan, apply and verify the permission recipe."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from rootstock.errors import LayoutError, RootstockError
from rootstock.install.layout import InstallLayout, read_layout, update_layout
from rootstock.install.machine import resolve_cache_root, resolve_root
from rootstock.install.perms import (
    PermCommand,
    PermRecipe,
    build_recipe,
    missing_programs,
    missing_tools_error,
    missing_tools_note,
)
from rootstock.install.perms_check import PermReport, check_perms
from rootstock.install.sharing import SHARED_KEY, root_is_shared

_OUTPUT_TAIL = 4000


@dataclass(frozen=True)
class CommandRun:
    """One recipe command as it ran."""

    command: PermCommand
    returncode: int
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass
class SetupResult:
    """What ``setup-perms --apply`` ran, where it stopped, and what the check found."""

    recipe: PermRecipe
    ran: list[CommandRun] = field(default_factory=list)
    not_run: list[PermCommand] = field(default_factory=list)
    report: PermReport | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> CommandRun | None:
        return next((r for r in self.ran if not r.ok), None)

    @property
    def ok(self) -> bool:
        return self.failed is None and self.report is not None and self.report.ok


def resolve_for_perms(
    root: str | None, cluster: str | None, cache_root: str | None
) -> InstallLayout:
    """Both roots, where neither need exist yet (setup-perms runs before init).

    A ``layout.json`` that the caller cannot read is itself a permission problem
    for check-perms to report, so it falls back to the cache-root override, or
    the root itself, rather than failing.
    """
    resolved = resolve_root(root, cluster)
    try:
        cache = resolve_cache_root(resolved, cache_root, cluster)
    except LayoutError:
        if os.access(resolved / "layout.json", os.R_OK):
            raise
        cache = Path(cache_root).expanduser().absolute() if cache_root else resolved
    return InstallLayout(resolved, cache)


def plan_setup(
    layout: InstallLayout,
    group: str,
    retrofit: bool = False,
    usage_dir: str | None = None,
    no_usage_spool: bool = False,
) -> PermRecipe:
    """The recipe for ``layout``; nothing is changed.

    A program the recipe needs and this machine lacks becomes a note, so the dry
    run says so before anyone saves the script and runs it.
    """
    recipe = build_recipe(layout, group, retrofit, usage_dir, no_usage_spool)
    missing = missing_programs(recipe.commands)
    if missing:
        recipe = replace(recipe, notes=(*recipe.notes, missing_tools_note(missing)))
    return recipe


def require_tools(recipe: PermRecipe) -> None:
    """Raise :class:`~rootstock.install.perms.PermToolMissing` unless PATH has every program."""
    missing = missing_programs(recipe.commands)
    if missing:
        raise missing_tools_error(missing)


def run_perm_command(command: PermCommand) -> CommandRun:
    """Run one recipe command (the only place setup-perms starts a process)."""
    env = {**os.environ, "LC_ALL": "C"}
    try:
        proc = subprocess.run(
            list(command.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            check=False,
        )
    except OSError as exc:
        # apply_setup checked PATH up front; this is a program removed since.
        hint = missing_tools_error([command.argv[0]]).hint
        return CommandRun(command, 127, f"{command.argv[0]}: {exc.strerror} ({hint})")
    return CommandRun(command, proc.returncode, proc.stdout[-_OUTPUT_TAIL:])


def apply_setup(
    recipe: PermRecipe,
    layout: InstallLayout,
    on_command: Callable[[PermCommand], None] = lambda _c: None,
    runner: Callable[[PermCommand], CommandRun] = run_perm_command,
) -> SetupResult:
    """Run the recipe in order, stop at the first failure, then check the result.

    The commands run with umask 002, so whatever ``mkdir -p`` creates above the
    roots is world-traversable. A program missing from ``PATH`` (``setfacl``, from
    the ``acl`` package) raises :class:`~rootstock.install.perms.PermToolMissing`
    before the first command, rather than half-applying the recipe. A recipe that
    ran to the end records the root as shared in its ``layout.json``, if it has one.
    """
    require_tools(recipe)
    result = SetupResult(recipe)
    previous = os.umask(0o002)
    try:
        for index, command in enumerate(recipe.commands):
            on_command(command)
            run = runner(command)
            result.ran.append(run)
            if not run.ok:
                result.not_run = list(recipe.commands[index + 1 :])
                break
        if result.failed is None:
            _record_shared(layout, result.notes)
    finally:
        os.umask(previous)
    result.report = check_perms(layout, recipe.group, full=True)
    return result


def _record_shared(layout: InstallLayout, notes: list[str]) -> None:
    """Record ``"shared": true`` in an existing ``layout.json`` (``init`` sees a root
    made by setup-perms as shared from its setgid bit, so a missing one is fine)."""
    try:
        data = read_layout(layout.root)
        if data is not None and data.get(SHARED_KEY) is not True:
            update_layout(layout.root, shared=True)
    except (OSError, RootstockError) as exc:
        notes.append(
            f"could not record the root as shared in {layout.layout_file}: {exc}; "
            f"`rootstock init --root {layout.root} --force --shared` does it"
        )


def check(layout: InstallLayout, group: str | None = None, full: bool = True) -> PermReport:
    """The read-only check (``full`` for check-perms, quick for install's warning)."""
    return check_perms(layout, group, full=full)


def problems_for_others(layout: InstallLayout) -> PermReport | None:
    """Install's up-front check: the quick report on a shared root, None on a private one."""
    if not root_is_shared(layout):
        return None
    return check_perms(layout, full=False)
