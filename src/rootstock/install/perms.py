"""The permission recipe for a shared install: what ``setup-perms`` runs.

The contract (docs/permissions.md): maintainers, and only maintainers, can write;
members of the project group inherit write; everyone else can read and traverse;
files created later inherit the group, world-read and group-write. The recipe
gets there with the owning group, setgid directories, an access ACL and a
default ACL that both carry a named entry for the project group.

It is a list of shell commands, rendered for review (the dry run) or run one by
one (``--apply``), in four phases whose order matters:

1. ``create`` - the roots, the in-root uv cache and the usage spool (setup-perms
   runs before ``init``, so nothing need exist yet);
2. ``group`` - ``chgrp`` to the project group;
3. ``acl`` - ``setfacl`` access and default ACLs;
4. ``mode`` - ``chmod``, **last**: writing an ACL rewrites a path's mode bits, and
   some filesystems (NERSC CFS) clear setgid when they do, so the mode is asserted
   after every ACL write. ``chmod`` on a path with an ACL also sets the ACL mask
   from the group bits, which undoes any mask clamp.

This module only decides what to run; ``ops/perms.py`` runs it and
``install/perms_check.py`` verifies the result.
"""

from __future__ import annotations

import contextlib
import grp
import os
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rootstock.errors import RootstockError, UsageError
from rootstock.install.layout import InstallLayout

PHASES = ("create", "group", "acl", "mode")

# The marker that records "no usage spool, on purpose" (--no-usage-spool). It lives
# next to where the spool would be, in the cache root, because setup-perms runs
# before init and layout.json must not exist yet (init would refuse the root).
USAGE_DISABLED_MARKER = "usage.disabled"

DIR_MODE = "2775"  # rwxrwsr-x: group write, world read + traverse, setgid
SPOOL_MODE = "1777"  # sticky and world-writable, like /tmp


class PermsError(RootstockError):
    """The recipe cannot be built for these paths (e.g. a populated spool in the way)."""


class PermToolMissing(PermsError):
    """A program the recipe runs (``setfacl``, most often) is not installed here."""


# Where each program of the recipe comes from, for the message when one is missing.
_PACKAGES = {"setfacl": "acl", "getfacl": "acl", "find": "findutils"}


@dataclass(frozen=True)
class PermCommand:
    """One command of the recipe, with the phase it belongs to and why it is there."""

    phase: str
    argv: tuple[str, ...]
    why: str

    def shell(self) -> str:
        """The command as one line a shell would run."""
        return shlex.join(self.argv)


@dataclass(frozen=True)
class PermRecipe:
    """The ordered commands for one install, and what the user should know first."""

    root: Path
    cache_root: Path
    group: str
    spool: Path | None  # the real spool directory (a --usage-dir target, or {cache}/usage)
    commands: tuple[PermCommand, ...]
    notes: tuple[str, ...]

    def script(self) -> str:
        """The recipe as a shell script (what the dry run prints)."""
        lines = [f"# note: {note}" for note in self.notes]
        lines.append("umask 002")
        lines += [c.shell() for c in self.commands]
        return "\n".join(lines) + "\n"


@contextlib.contextmanager
def maintainer_umask() -> Iterator[None]:
    """Force umask 002 so every file this process and its children create is
    world-readable and group-writable, whatever the maintainer's own umask is.

    It is the recipe's ``umask 002`` for the commands that write the install
    (``init``, ``install``, ``add``, ``smoke-test``), so what they add keeps the
    permissions ``setup-perms`` set.
    """
    previous = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(previous)


def dir_acl(group: str) -> str:
    """The access and default ACL of every shared directory."""
    return f"u::rwx,g::rwx,g:{group}:rwx,m::rwx,o::r-x"


def tree_acl(group: str) -> str:
    """The ACL for a retrofit: ``X`` keeps plain files non-executable."""
    return f"u::rwX,g::rwX,g:{group}:rwX,m::rwX,o::rX"


def spool_default_acl(group: str) -> str:
    """The spool's default ACL: records readable by the project group, by nobody else."""
    return f"u::rwx,g::---,g:{group}:rwx,m::rwx,o::---"


def usage_disabled_marker(layout: InstallLayout) -> Path:
    """The file whose presence says the install has no usage spool on purpose."""
    return layout.cache_root / USAGE_DISABLED_MARKER


def validate_group(group: str) -> int:
    """The gid of ``group`` (a name or a number), or a usage error if it is unknown."""
    try:
        return grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise UsageError(
            f"there is no group {group!r} on this machine",
            hint="pass your project group (`id -Gn` lists yours)",
        ) from None


def recipe_programs(commands: tuple[PermCommand, ...]) -> list[str]:
    """Every program the commands start, ``find -exec``'s included, in first-use order."""
    programs = []
    for command in commands:
        argv = command.argv
        programs.append(argv[0])
        programs += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-exec"]
    return list(dict.fromkeys(programs))


def missing_programs(commands: tuple[PermCommand, ...], path: str | None = None) -> list[str]:
    """The programs of ``commands`` that ``PATH`` (or ``path``) does not hold."""
    return [p for p in recipe_programs(commands) if shutil.which(p, path=path) is None]


def missing_tools_error(missing: list[str]) -> PermToolMissing:
    """The error for programs that are not installed: which, and which package has them."""
    verb = "is" if len(missing) == 1 else "are"
    return PermToolMissing(
        f"setup-perms needs {_with_packages(missing)}, which {verb} not installed here "
        "(not on PATH); nothing was changed",
        hint=f"{_install_hint(missing)}, then run setup-perms again",
    )


def missing_tools_note(missing: list[str]) -> str:
    """The dry run's note for the same: the script it prints would stop there."""
    verb = "is" if len(missing) == 1 else "are"
    return (
        f"{_with_packages(missing)} {verb} not installed here (not on PATH): "
        f"{_install_hint(missing)} before running these commands"
    )


def _with_packages(missing: list[str]) -> str:
    return ", ".join(f"{p} (package {_PACKAGES.get(p, 'coreutils')})" for p in missing)


def _install_hint(missing: list[str]) -> str:
    names = " ".join(dict.fromkeys(_PACKAGES.get(p, "coreutils") for p in missing))
    return (
        f"install it (Debian/Ubuntu: `sudo apt install {names}`; RHEL/Fedora: "
        f"`sudo dnf install {names}`), or ask your sysadmin"
    )


def build_recipe(
    layout: InstallLayout,
    group: str,
    retrofit: bool = False,
    usage_dir: str | os.PathLike | None = None,
    no_usage_spool: bool = False,
) -> PermRecipe:
    """Decide the commands that make ``layout`` a shared install for ``group``.

    Reads the filesystem (what exists, what the spool is) but changes nothing.
    """
    if usage_dir is not None and no_usage_spool:
        raise UsageError("--usage-dir and --no-usage-spool contradict each other")
    gid = validate_group(group)
    notes: list[str] = []
    if os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
        notes.append(
            f"you are not in group {group} in this session, so chgrp will fail; "
            "if you were added recently, log in again (or run `newgrp`)"
        )
    commands = _Commands()
    root, cache = layout.root, layout.cache_root
    uv_cache = layout.uv_cache_dir
    dirs = _unique([root, uv_cache, cache])
    for path in dirs:
        commands.add("create", "mkdir", "-p", "--", str(path), why="create the root")

    spool = _plan_spool(layout, group, usage_dir, no_usage_spool, commands, notes)

    trees = _unique_trees([root, cache]) if retrofit else []
    if not retrofit and _has_entries(uv_cache):
        # uv hard-links files from its cache into the envs, and a hard link keeps
        # the cache file's group and ACL, so an existing cache must be fixed in full.
        trees.append(uv_cache)
        notes.append(f"{uv_cache} already holds files: the recipe fixes it recursively")
    prune = [p for p in (layout.usage_dir, spool) if p is not None]

    for path in dirs:
        commands.add("group", "chgrp", "--", group, str(path), why="hand the root to the group")
    if spool is not None:
        commands.add("group", "chgrp", "--", group, str(spool), why="the spool's group")
    for tree in trees:
        commands.add(
            "group",
            *_find(tree, prune, "!", "-type", "l", "!", "-group", group),
            *("-exec", "chgrp", group, "{}", "+"),
            why="retrofit: hand existing files to the group",
        )
    for path in dirs:
        commands.add("acl", "setfacl", "-m", dir_acl(group), "--", str(path), why="access ACL")
        commands.add(
            "acl", "setfacl", "-d", "-m", dir_acl(group), "--", str(path), why="default ACL"
        )
    for tree in trees:
        commands.add(
            "acl",
            *_find(tree, prune, "!", "-type", "l"),
            *("-exec", "setfacl", "-m", tree_acl(group), "{}", "+"),
            why="retrofit: access ACL on existing files",
        )
        commands.add(
            "acl",
            *_find(tree, prune, "-type", "d"),
            *("-exec", "setfacl", "-d", "-m", dir_acl(group), "{}", "+"),
            why="retrofit: default ACL on existing directories",
        )
    if spool is not None:
        commands.add(
            "acl",
            *("setfacl", "-d", "-m", spool_default_acl(group), "--", str(spool)),
            why="records readable by the project group only",
        )

    for tree in trees:
        commands.add(
            "mode",
            *_find(tree, prune, "!", "-type", "l"),
            *("-exec", "chmod", "u+rwX,g+rwX,o+rX", "{}", "+"),
            why="retrofit: world-readable files",
        )
        commands.add(
            "mode",
            *_find(tree, prune, "-type", "d"),
            *("-exec", "chmod", "g+s", "{}", "+"),
            why="retrofit: setgid on existing directories",
        )
    for path in dirs:
        commands.add("mode", "chmod", DIR_MODE, "--", str(path), why="setgid, after the ACLs")
    if layout.locks_dir.is_dir():
        # Whoever can open a lock file can stall every maintainer's write with a read
        # lock: the lock directory is the maintainers' alone (the retrofit opened it).
        commands.add(
            "mode", "chmod", "-R", "o-rwx", "--", str(layout.locks_dir), why="private locks"
        )
    if spool is not None:
        commands.add("mode", "chmod", SPOOL_MODE, "--", str(spool), why="the 1777 spool")
    if no_usage_spool:
        marker = str(usage_disabled_marker(layout))
        commands.add("mode", "chmod", "0664", "--", marker, why="world-readable marker")
    return PermRecipe(root, cache, group, spool, commands.ordered(), tuple(notes))


def _plan_spool(
    layout: InstallLayout,
    group: str,
    usage_dir: str | os.PathLike | None,
    no_usage_spool: bool,
    commands: _Commands,
    notes: list[str],
) -> Path | None:
    """Add the spool's create commands; return the real spool directory (or None)."""
    link = layout.usage_dir
    marker = usage_disabled_marker(layout)
    if no_usage_spool:
        if link.exists() or link.is_symlink():
            notes.append(
                f"{link} exists and is left alone; remove it yourself if usage "
                "collection should stop"
            )
        commands.add("create", "touch", "--", str(marker), why="record: no usage spool")
        return None
    if marker.exists():
        commands.add("create", "rm", "-f", "--", str(marker), why="the spool is back")
    if usage_dir is None:
        if link.is_symlink():
            target = Path(os.path.realpath(link))
            notes.append(f"{link} is a link to {target}; the spool stays there")
            commands.add("create", "mkdir", "-p", "--", str(target), why="the spool")
            return target
        commands.add("create", "mkdir", "-p", "--", str(link), why="the usage spool")
        return link
    target = Path(usage_dir).expanduser().absolute()
    commands.add("create", "mkdir", "-p", "--", str(target), why="the spool outside the install")
    if link.is_dir() and not link.is_symlink():
        if _has_entries(link):
            raise PermsError(
                f"{link} already holds usage records, so it cannot become a link to {target}",
                hint=f"move its files into {target}, remove {link}, and run this again",
            )
        commands.add("create", "rmdir", "--", str(link), why="make room for the link")
    commands.add(
        "create", "ln", "-sfnT", "--", str(target), str(link), why="sessions follow the link"
    )
    notes.append(
        f"the spool's ancestors need o+x for everyone (e.g. `chmod o+x ~` if {target} "
        "is under your home)"
    )
    return target


class _Commands:
    """Collects commands, then returns them in phase order (stable within a phase)."""

    def __init__(self) -> None:
        self._items: list[PermCommand] = []

    def add(self, phase: str, *argv: str, why: str) -> None:
        self._items.append(PermCommand(phase, tuple(argv), why))

    def ordered(self) -> tuple[PermCommand, ...]:
        return tuple(sorted(self._items, key=lambda c: PHASES.index(c.phase)))


def _find(tree: Path, prune: list[Path], *tests: str) -> tuple[str, ...]:
    """``find TREE`` skipping the spool (users' private records), then ``tests``."""
    args = ["find", str(tree)]
    for path in prune:
        if _is_under(path, tree) and path != tree:
            args += ["-path", str(path), "-prune", "-o"]
    return (*args, *tests)


def _unique(paths: list[Path]) -> list[Path]:
    seen: list[Path] = []
    for path in paths:
        if path not in seen:
            seen.append(path)
    return seen


def _unique_trees(paths: list[Path]) -> list[Path]:
    """Drop any tree that lies inside another (one walk covers it)."""
    unique = _unique(paths)
    return [p for p in unique if not any(q != p and _is_under(p, q) for q in unique)]


def _is_under(path: Path, tree: Path) -> bool:
    return path == tree or tree in path.parents


def _has_entries(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is not None
    except OSError:
        return False
