"""The read-only permission check behind ``check-perms`` and install's up-front warning.

It stats the roots and a handful of paths every user reads (never the tree
below them: that is ``scripts/check_world_readable.sh``), so it is fast enough
for a login node and for every ``rootstock install``. Two scopes:

* ``full`` (``check-perms``): every ancestor of each root needs o+x; each root
  needs o+rx, setgid, an access and a default ACL with a named-group entry and no
  mask clamp; ``layout.json``, ``manifest.json`` and each env's files must be
  world-readable; the usage spool must be mode 1777 unless it is off on purpose;
  each env's base interpreter, and every directory on the way to it, must be
  executable by others.
* quick (``install`` and ``add`` up front): the roots themselves only.

Problem kinds (stable; ``check-perms --json`` reports them): ``missing``,
``ancestor-traverse``, ``not-world-readable``, ``no-setgid``, ``wrong-group``,
``no-group-acl``, ``no-default-acl``, ``mask-clamp``, ``user-acl``,
``acl-unsupported``, ``spool``, ``interpreter`` and ``locks-open``.

The one directory others must *not* reach is the install's lock directory
(``.locks``): a read lock needs only read access, so anyone who could open a lock
file could stall every maintainer's write (``locks-open``, in both scopes).
"""

from __future__ import annotations

import grp
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from rootstock.install.acl import Acl, AclUnsupported, perm_text, read_acl
from rootstock.install.envs import ENV_METADATA
from rootstock.install.images import IMAGE_NAME
from rootstock.install.layout import InstallLayout
from rootstock.install.parsing import loads_json
from rootstock.install.perms import SPOOL_MODE, dir_acl, usage_disabled_marker, validate_group

_KEY_FILES = ("layout.json", "manifest.json")
_KEY_DIRS = ("environments", "envs")
_ENV_FILES = ("env_source.py", ENV_METADATA)


@dataclass(frozen=True)
class PermProblem:
    """One thing that keeps the install from being usable by everyone."""

    kind: str
    path: str
    message: str
    fix: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": self.path, "message": self.message, "fix": self.fix}


@dataclass
class PermReport:
    """What the check looked at and what it found."""

    root: Path
    cache_root: Path
    group: str | None
    spool: dict = field(default_factory=dict)
    checked: int = 0
    problems: list[PermProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        """The stable ``check-perms --json`` shape (docs/permissions.md)."""
        return {
            "ok": self.ok,
            "root": str(self.root),
            "cache_root": str(self.cache_root),
            "group": self.group,
            "usage_spool": self.spool,
            "checked": self.checked,
            "problems": [p.to_dict() for p in self.problems],
        }


def check_perms(layout: InstallLayout, group: str | None = None, full: bool = True) -> PermReport:
    """Check ``layout`` against the shared-install contract; read-only."""
    gid = validate_group(group) if group else None
    check = _Checker(PermReport(layout.root, layout.cache_root, group), group, gid)
    # Replaced by _check_spool; left as is when there is no cache root to look in.
    check.report.spool = {"path": str(layout.usage_dir), "target": None, "state": "unchecked"}
    roots = [layout.root, layout.cache_root] if layout.cache_root != layout.root else [layout.root]
    if full:
        for root in roots:
            check.ancestors(root)
    for root in roots:
        check.shared_dir(root, required=True)
    check.private_locks(layout.locks_dir)
    check.shared_dir(layout.uv_cache_dir, required=False)
    if full and layout.root.is_dir():
        _check_contents(check, layout)
    if full and layout.cache_root.is_dir():
        _check_spool(check, layout)
    return check.report


class _Checker:
    """Accumulates problems; each method stats a path or two."""

    def __init__(self, report: PermReport, group: str | None, gid: int | None) -> None:
        self.report = report
        self.group = group
        self.gid = gid
        self._seen_ancestors: set[Path] = set()

    def add(self, kind: str, path: Path | str, message: str, fix: str) -> None:
        self.report.problems.append(PermProblem(kind, str(path), message, fix))

    def stat(self, path: Path) -> os.stat_result | None:
        self.report.checked += 1
        try:
            return os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.add("ancestor-traverse", path, f"cannot stat it: {exc.strerror}", _ask(path))
            return None

    def ancestors(self, path: Path, needed_by: str = "") -> bool:
        """Every directory above ``path`` (as given and resolved) needs o+x."""
        ok = True
        for parent in _ancestor_chain(path):
            if parent in self._seen_ancestors:
                continue
            self._seen_ancestors.add(parent)
            st = self.stat(parent)
            if st is not None and not st.st_mode & stat.S_IXOTH:
                ok = False
                suffix = f" (needed by {needed_by})" if needed_by else ""
                self.add(
                    "ancestor-traverse",
                    parent,
                    f"others cannot traverse it (mode {_mode(st)}){suffix}",
                    f"chmod o+x {parent}  {_ask(parent)}",
                )
        return ok

    def shared_dir(self, path: Path, required: bool) -> None:
        """A root: o+rx, setgid, the group, both ACLs with a named group, no clamp."""
        st = self.stat(path)
        if st is None:
            if required:
                group = self.group or "GROUP"
                self.add(
                    "missing",
                    path,
                    "does not exist",
                    f"`rootstock setup-perms {self.report.root} --group {group} --apply` "
                    "creates the roots, before `rootstock init`",
                )
            return
        if not stat.S_ISDIR(st.st_mode):
            self.add("missing", path, "is not a directory", "remove it or choose another root")
            return
        if st.st_mode & 0o005 != 0o005:
            self.add(
                "not-world-readable",
                path,
                f"others cannot list and traverse it (mode {_mode(st)})",
                f"chmod o+rx {path}",
            )
        if not st.st_mode & stat.S_ISGID:
            self.add(
                "no-setgid",
                path,
                "no setgid bit: new files get their creator's group, not the project's",
                f"chmod g+s {path}",
            )
        if self.gid is not None and st.st_gid != self.gid:
            self.add(
                "wrong-group",
                path,
                f"its group is {_group_name(st.st_gid)}, not {self.group}",
                f"chgrp {self.group} {path}",
            )
        try:
            access, default = read_acl(path), read_acl(path, default=True)
        except AclUnsupported:
            self.add(
                "acl-unsupported",
                path,
                "the filesystem exposes no POSIX ACLs here; only the mode bits and "
                "setgid carry the contract",
                "ask the facility how group inheritance works on this filesystem",
            )
            return
        self._acl(path, access, default=False)
        self._acl(path, default, default=True)

    def private_locks(self, path: Path) -> None:
        """The lock directory: no access at all for others."""
        st = self.stat(path)
        if st is None or not stat.S_ISDIR(st.st_mode) or not st.st_mode & 0o007:
            return
        self.add(
            "locks-open",
            path,
            f"others can open the install's lock files (mode {_mode(st)}): a read lock "
            "on one stalls every maintainer's write",
            f"chmod -R o-rwx {path}  (as its owner, whose next install or add does it too)",
        )

    def _acl(self, path: Path, acl: Acl | None, default: bool) -> None:
        flag, what = ("-d ", "default ACL") if default else ("", "ACL")
        group = self.group or "<group>"
        if acl is None:
            kind = "no-default-acl" if default else "no-group-acl"
            detail = (
                "new files will not inherit group write and world read"
                if default
                else "no named entry for the project group"
            )
            self.add(
                kind,
                path,
                f"no {what}: {detail}",
                f"setfacl {flag}-m {dir_acl(group)} {path}",
            )
            return
        granted = acl.group_perms(self.gid) if self.gid is not None else None
        if not acl.named_groups or (self.gid is not None and granted != 0o7):
            who = f"group:{self.group}:rwx" if self.group else "a named-group entry"
            self.add(
                "no-group-acl",
                path,
                f"the {what} lacks {who}",
                f"setfacl {flag}-m g:{group}:rwx {path}",
            )
        if acl.mask is not None and acl.mask != 0o7:
            self.add(
                "mask-clamp",
                path,
                f"the {what} mask is {perm_text(acl.mask)}: it clamps group entries"
                + (" of every new file" if default else ""),
                f"setfacl {flag}-m m::rwx {path}",
            )
        if default and acl.other is not None and acl.other & 0o5 != 0o5:
            self.add(
                "not-world-readable",
                path,
                f"the default ACL gives others {perm_text(acl.other)}: new files will "
                "not be world-readable",
                f"setfacl -d -m o::r-x {path}",
            )
        for entry in acl.named_users:
            self.add(
                "user-acl",
                path,
                f"per-user {what} entry {entry.text()}: grant access through the group",
                f"setfacl {flag}-x u:{entry.name} {path}",
            )

    def readable(self, path: Path, directory: bool) -> None:
        """A path every user reads: o+r (and o+x for a directory), no clamp or user entry."""
        st = self.stat(path)
        if st is None:
            return
        need = 0o005 if directory else 0o004
        if st.st_mode & need != need:
            self.add(
                "not-world-readable",
                path,
                f"others cannot read it (mode {_mode(st)})",
                f"chmod o+{'rx' if directory else 'r'} {path}",
            )
        try:
            acl = read_acl(path)
        except (AclUnsupported, OSError):
            return
        if acl is None:
            return
        if acl.mask is not None and not acl.mask & 0o4:
            self.add(
                "mask-clamp",
                path,
                f"ACL mask {perm_text(acl.mask)}: group members cannot read it",
                f"setfacl -m m::r{'wx' if directory else 'w'} {path}",
            )
        for entry in acl.named_users:
            self.add(
                "user-acl",
                path,
                f"per-user ACL entry {entry.text()}: grant access through the group",
                f"setfacl -x u:{entry.name} {path}",
            )

    def executable(self, path: Path, env: str) -> None:
        """An env's base interpreter: o+x on it and on every directory above it."""
        if not self.ancestors(path, needed_by=f"the interpreter of env {env!r}"):
            return
        st = self.stat(path)
        if st is None:
            self.add(
                "interpreter",
                path,
                f"env {env!r} is built on an interpreter that does not exist",
                f"rebuild it: rootstock install {env} --force --python /usr/bin/python3",
            )
        elif not st.st_mode & stat.S_IXOTH:
            self.add(
                "interpreter",
                path,
                f"env {env!r} is built on an interpreter others cannot execute (mode {_mode(st)})",
                f"chmod o+rx {path}, or rebuild the env on a world-usable Python "
                f"(rootstock install {env} --force --python /usr/bin/python3)",
            )


def _check_contents(check: _Checker, layout: InstallLayout) -> None:
    for name in _KEY_FILES:
        check.readable(layout.root / name, directory=False)
    for name in _KEY_DIRS:
        check.readable(layout.root / name, directory=True)
    try:
        names = sorted(n for n in os.listdir(layout.envs_dir) if not n.startswith("."))
    except OSError:
        names = []
    for name in names:
        env_dir = layout.env_dir(name)
        check.readable(env_dir, directory=True)
        for filename in _ENV_FILES:
            check.readable(env_dir / filename, directory=False)
        if (env_dir / IMAGE_NAME).exists():
            # Every user's worker stages from it (docs/cold-start.md).
            check.readable(env_dir / IMAGE_NAME, directory=False)
        for interpreter in _env_interpreters(env_dir):
            check.executable(interpreter, name)


def _env_interpreters(env_dir: Path) -> list[Path]:
    """The base interpreter(s) an env runs on: recorded, and what bin/python resolves to."""
    found: list[Path] = []
    try:
        recorded = loads_json((env_dir / ENV_METADATA).read_bytes())["interpreter"]["path"]
        found.append(Path(recorded))
    except (OSError, ValueError, KeyError, TypeError):
        home = _pyvenv_home(env_dir)
        if home is not None:
            found.append(home / "python3")
    python = env_dir / "bin" / "python"
    if python.is_symlink():
        resolved = Path(os.path.realpath(python))
        if resolved not in found and not _is_under(resolved, env_dir):
            found.append(resolved)
    return found


def _pyvenv_home(env_dir: Path) -> Path | None:
    try:
        for line in (env_dir / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                return Path(value.strip())
    except OSError:
        pass
    return None


def _check_spool(check: _Checker, layout: InstallLayout) -> None:
    link = layout.usage_dir
    marker = usage_disabled_marker(layout)
    spool: dict = {"path": str(link), "target": None, "state": "missing"}
    check.report.spool = spool
    if link.is_symlink():
        target = Path(os.path.realpath(link))
        spool.update(target=str(target), state="linked")
        if not target.is_dir():
            spool["state"] = "broken"
            check.add(
                "spool",
                link,
                f"the spool link points to {target}, which is not a directory",
                f"rootstock setup-perms --usage-dir {target} ... (recreates it)",
            )
            return
        check.ancestors(target, needed_by="the usage spool")
    elif link.is_dir():
        target = link
        spool["state"] = "present"
    else:
        if marker.exists():
            spool["state"] = "disabled"
        else:
            check.add(
                "spool",
                link,
                "there is no usage spool, and no record that it is off on purpose",
                "rootstock setup-perms ... creates it; --no-usage-spool records that it is off",
            )
        return
    st = check.stat(target)
    if st is not None and st.st_mode & 0o1777 != 0o1777:
        check.add(
            "spool",
            target,
            f"the usage spool has mode {_mode(st)}, not {SPOOL_MODE}: sessions cannot "
            "drop records (calculations still work)",
            f"chmod {SPOOL_MODE} {target}",
        )


def _ancestor_chain(path: Path) -> list[Path]:
    """Directories above ``path`` as written and as resolved, top down, without repeats."""
    absolute = Path(os.path.abspath(path))
    chain: list[Path] = []
    for candidate in (absolute, Path(os.path.realpath(absolute))):
        for parent in reversed(candidate.parents):
            if parent not in chain:
                chain.append(parent)
    return chain


def _is_under(path: Path, tree: Path) -> bool:
    return path == tree or tree in path.parents


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _ask(path: Path) -> str:
    return f"(not yours? ask the owner of {path}, or the facility)"
