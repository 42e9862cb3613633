"""SOURCE: the env files that ``sync`` and ``prune`` converge an install to.

A SOURCE is one of three things:

* the registered sources, ``{root}/environments/*.py`` (no SOURCE given);
* a directory of env files (the ``*.py`` files directly in it, no recursion);
* ``git+URL[@REF][#subdirectory=DIR]``, pip's syntax, fetched shallowly with the
  system ``git`` into a private temp dir that lives as long as the context.

Every way of reading one fails loudly: a SOURCE that is missing, unreadable, or holds
no env file raises :class:`SourceError`, because a converging command that read it as
"nothing declared" would prune the whole install.

Git is run as untrusted input demands: the URL and REF are refused when they start
with ``-`` (before git runs) and always follow ``--``; only the ``file``, ``https``,
``http``, ``ssh`` and ``git`` transports are allowed; submodules are never fetched or
checked out; the caller's ``GIT_*`` variables (``GIT_DIR``, ``GIT_CONFIG_*``) are
dropped; and every git runs under the build supervisor (:mod:`rootstock.install.supervise`),
so a timeout, or the death of rootstock however it dies, ends git and its children.
A commit SHA that the server will not hand out shallowly is fetched with every
branch and tag in full instead (see ``_fetch``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rootstock.errors import SourceError, UsageError
from rootstock.install.layout import InstallLayout
from rootstock.install.supervise import run_supervised
from rootstock.runtime import make_private_dir

__all__ = [
    "GIT_SCHEMES",
    "GIT_TIMEOUT_S",
    "EnvSource",
    "GitSpec",
    "open_source",
    "parse_source_spec",
]

#: Seconds one git command may run before it (and its children) are ended.
GIT_TIMEOUT_S = 300.0
#: The transports a git SOURCE may use (``git+<scheme>://``); ``ext::`` and the like
#: run commands, so they are refused here and by ``GIT_ALLOW_PROTOCOL`` too.
GIT_SCHEMES = ("file", "https", "http", "ssh", "git")
#: The caller's ``GIT_*`` variables that are kept: how to reach a server, never where
#: the repository is or what config to inject.
_GIT_KEPT = frozenset(
    {"GIT_SSH", "GIT_SSH_COMMAND", "GIT_SSH_VARIANT", "GIT_SSL_CAINFO", "GIT_SSL_CAPATH"}
)
_GIT_PREFIX = "git+"
#: A commit name git fetch may refuse to fetch shallowly (an abbreviated or
#: unadvertised SHA); such a REF gets the full-fetch fallback.
_HEX_REF = re.compile(r"[0-9a-fA-F]{4,64}")
_CHECKOUT = "checkout"
#: How many of git's last stderr lines an error shows.
_GIT_ERROR_LINES = 6


@dataclass(frozen=True)
class GitSpec:
    """A parsed ``git+URL[@REF][#subdirectory=DIR]``: the URL without ``git+``."""

    url: str
    ref: str | None = None
    subdirectory: str | None = None


@dataclass(frozen=True)
class EnvSource:
    """One opened SOURCE: where its env files are, and which ones."""

    label: str  # what the user gave (or "registered sources in ..."), for messages
    kind: str  # "dir" | "git" | "registered"
    directory: Path  # the directory holding the env files (inside the checkout for git)
    files: list[Path]  # the *.py files directly in it, sorted by name
    revision: str | None = None  # git: the checked-out commit's full SHA

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` shape: label, kind, directory, file names, revision."""
        return {
            "label": self.label,
            "kind": self.kind,
            "directory": str(self.directory),
            "files": [p.name for p in self.files],
            "revision": self.revision,
        }


# --- parsing -----------------------------------------------------------------------------


def _refuse_dash(what: str, value: str, spec: str) -> None:
    if value.startswith("-"):
        raise UsageError(
            f"SOURCE {spec!r}: the {what} {value!r} starts with '-'",
            hint="a git URL or ref never starts with '-'; it would be read as a git option",
        )


def _malformed(spec: str, why: str) -> UsageError:
    return UsageError(
        f"malformed git SOURCE {spec!r}: {why}",
        hint="the form is git+URL[@REF][#subdirectory=DIR], "
        "e.g. git+https://github.com/org/envs.git@v1#subdirectory=environments",
    )


def _clean_subdirectory(spec: str, value: str) -> str:
    """``value`` as a normalised relative path, or UsageError if it could leave the checkout."""
    if not value or "\\" in value or "\0" in value:
        raise _malformed(spec, f"subdirectory {value!r} is not a plain relative path")
    if value.startswith("/"):
        raise _malformed(
            spec, f"subdirectory {value!r} is absolute; give it relative to the repository"
        )
    parts = [p for p in value.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _malformed(spec, f"subdirectory {value!r} climbs out of the repository ('..')")
    if not parts:
        raise _malformed(spec, f"subdirectory {value!r} names the repository itself; leave it out")
    return "/".join(parts)


def _split_fragment(spec: str, fragment: str) -> str | None:
    """The ``subdirectory`` of ``#subdirectory=DIR`` (pip also allows ``egg=``, ignored)."""
    subdirectory: str | None = None
    for item in fragment.split("&"):
        key, eq, value = item.partition("=")
        if not eq:
            raise _malformed(spec, f"fragment {item!r} is not KEY=VALUE")
        if key == "subdirectory":
            if subdirectory is not None:
                raise _malformed(spec, "subdirectory is given twice")
            subdirectory = _clean_subdirectory(spec, value)
        elif key != "egg":
            raise _malformed(spec, f"unknown fragment key {key!r} (only subdirectory=DIR)")
    return subdirectory


def parse_source_spec(spec: str) -> GitSpec | None:
    """Parse a SOURCE argument: None for a plain directory, a :class:`GitSpec` for git.

    ``git+URL[@REF][#subdirectory=DIR]`` follows pip: REF is after the last ``@`` of
    the URL's path, so the user part of ``git+ssh://git@host/x.git@v1`` is no ref and
    a branch may hold slashes (``@release/1.0``). Raises :class:`UsageError` (exit 2)
    for a SOURCE, URL or REF that starts with ``-``, a transport other than
    :data:`GIT_SCHEMES`, an empty part, or a subdirectory that is not a clean
    relative path.
    """
    if spec.startswith("-"):
        raise UsageError(
            f"SOURCE {spec!r} starts with '-'",
            hint="name a directory that starts with '-' as ./" + spec,
        )
    if not spec.startswith(_GIT_PREFIX):
        if not spec:
            raise UsageError("SOURCE is empty", hint="pass a directory of env files or git+URL")
        return None
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in spec):
        raise _malformed(spec, "it holds whitespace or a control character")
    rest = spec[len(_GIT_PREFIX) :]
    _refuse_dash("URL", rest, spec)
    location, hash_sign, fragment = rest.partition("#")
    subdirectory = _split_fragment(spec, fragment) if hash_sign else None
    scheme, sep, after_scheme = location.partition("://")
    if not sep or not scheme:
        raise _malformed(spec, "the URL has no scheme (git+file:///path, git+https://host/repo)")
    if scheme.lower() not in GIT_SCHEMES:
        raise _malformed(spec, f"transport {scheme!r} is not one of {', '.join(GIT_SCHEMES)}")
    # The authority ends at the first '/': an '@' before it is the user part.
    slash = after_scheme.find("/")
    authority, path = (
        (after_scheme, "") if slash < 0 else (after_scheme[:slash], after_scheme[slash:])
    )
    host = authority.rpartition("@")[2]
    if authority.startswith("-") or host.startswith("-"):
        raise UsageError(
            f"SOURCE {spec!r}: the host {host!r} starts with '-'",
            hint="a host name never starts with '-'; it would be read as an ssh option",
        )
    ref: str | None = None
    if "@" in path:
        path, _, ref = path.rpartition("@")
        if not ref:
            raise _malformed(
                spec, "nothing follows '@' (give a branch, tag or commit, or drop '@')"
            )
        _refuse_dash("ref", ref, spec)
    if scheme.lower() != "file" and not authority:
        raise _malformed(spec, "the URL has no host")
    if not path.strip("/"):
        raise _malformed(spec, "the URL names no repository")
    return GitSpec(url=f"{scheme}://{authority}{path}", ref=ref, subdirectory=subdirectory)


# --- listing env files -------------------------------------------------------------------


def _env_files(directory: Path, label: str, *, confine_to: Path | None) -> list[Path]:
    """The readable ``*.py`` files directly in ``directory``, sorted by name.

    Names starting with ``.`` are left out (editor lock files such as ``.#x.py``; no
    env name starts with one). ``confine_to``: a symlinked env file must resolve
    inside it (a git checkout), else SourceError; ``None`` allows any target (a
    directory of the user's own).
    """
    try:
        names = sorted(os.listdir(directory))
    except PermissionError:
        raise SourceError(
            f"cannot list SOURCE directory {directory} ({label})",
            hint="check its permissions: rootstock needs to read and enter it",
        ) from None
    except OSError as exc:
        raise SourceError(f"cannot list SOURCE directory {directory}: {exc.strerror}") from None
    files: list[Path] = []
    for name in names:
        if not name.endswith(".py") or name.startswith("."):
            continue
        path = directory / name
        try:
            link = os.lstat(path)
        except OSError:
            continue  # removed while listing
        if stat.S_ISLNK(link.st_mode):
            target = Path(os.path.realpath(path))
            if confine_to is not None and not _is_within(target, confine_to):
                raise SourceError(
                    f"env file {name} in {label} is a symlink to {os.readlink(path)}, "
                    "outside the checkout",
                    hint="a git SOURCE may only hold env files (or links) inside the repository",
                )
            if not target.exists():
                raise SourceError(
                    f"env file {path} is a broken symlink (to {os.readlink(path)})",
                    hint="fix or remove the link",
                )
        if not path.is_file():
            continue  # a directory named x.py, a socket: not an env file
        try:
            with open(path, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            raise SourceError(
                f"cannot read env file {path}: {exc.strerror}",
                hint="check its permissions: every env file of a SOURCE must be readable",
            ) from None
        files.append(path)
    return files


def _is_within(path: Path, top: Path) -> bool:
    return path == top or top in path.parents


def _directory_source(spec: str) -> EnvSource:
    # Absolute (symlinks kept), so --json and later reads do not depend on the cwd.
    directory = Path(spec).expanduser().absolute()
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        raise SourceError(
            f"SOURCE directory {directory} does not exist",
            hint="pass a directory of env files (*.py), or git+URL[@REF][#subdirectory=DIR]",
        ) from None
    except OSError as exc:
        raise SourceError(
            f"cannot read SOURCE {directory}: {exc.strerror}",
            hint="check the path and its permissions",
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(
            f"SOURCE {directory} is a file, not a directory",
            hint="pass the directory that holds the env files "
            "(`rootstock install FILE` installs a single one)",
        )
    files = _env_files(directory, spec, confine_to=None)
    if not files:
        raise SourceError(
            f"SOURCE directory {directory} holds no env files (*.py)",
            hint="pass the directory that holds the env files; an empty SOURCE never "
            "means 'nothing declared'",
        )
    return EnvSource(label=spec, kind="dir", directory=directory, files=files)


def _registered_source(layout: InstallLayout) -> EnvSource:
    directory = layout.environments_dir
    label = f"registered sources in {directory}"
    files = _env_files(directory, label, confine_to=None) if directory.is_dir() else []
    if not files:
        raise SourceError(
            f"no registered env files in {directory}",
            hint="pass a SOURCE directory (or git+URL), or `rootstock install ENV_FILE` first",
        )
    return EnvSource(label=label, kind="registered", directory=directory, files=files)


# --- git ---------------------------------------------------------------------------------


def git_environment() -> dict[str, str]:
    """The environment every git of a SOURCE runs with: no prompts, no system config,
    none of the caller's repository or config variables, the allowed transports only,
    and no Git LFS downloads (env files are plain Python)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in _GIT_KEPT}
    env.update(
        GIT_TERMINAL_PROMPT="0",
        GIT_CONFIG_NOSYSTEM="1",
        GIT_ALLOW_PROTOCOL=":".join(GIT_SCHEMES),
        GIT_LFS_SKIP_SMUDGE="1",
    )
    return env


def _git_binary() -> str:
    found = shutil.which("git")
    if found is None:
        raise SourceError(
            "cannot find the git executable on PATH (needed for a git+ SOURCE)",
            hint="install git, or check out the repository yourself and pass its directory",
        )
    return found


@dataclass(frozen=True)
class _Git:
    """How one SOURCE runs git: which binary, from where, named how in errors."""

    binary: str
    cwd: Path  # the private temp dir: git never starts inside the caller's repository
    spec: str

    def run(self, args: Sequence[str], what: str) -> subprocess.CompletedProcess[str]:
        """Run ``git ARGS`` under the supervisor; SourceError if it runs out of time."""
        # submodule.recurse=false: a user's config must not make checkout act on submodules.
        cmd = [self.binary, "-c", "submodule.recurse=false", *args]
        try:
            return run_supervised(cmd, env=git_environment(), cwd=self.cwd, timeout=GIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SourceError(
                f"git timed out after {GIT_TIMEOUT_S:.0f} s while {what} ({self.spec})",
                hint="check the network and that the server answers; try `git ls-remote URL`",
            ) from None

    def failed(self, proc: subprocess.CompletedProcess[str], what: str) -> SourceError:
        """The error for a git that exited non-zero, with its last stderr lines."""
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-_GIT_ERROR_LINES:])
        return SourceError(
            f"git failed while {what} ({self.spec}), exit code {proc.returncode}"
            + (f":\n{tail}" if tail else ""),
            hint="check the URL and the ref (branch, tag or commit), and the network",
        )

    def check(self, args: Sequence[str], what: str) -> str:
        """Run ``git ARGS``; its stdout, or SourceError with git's last stderr lines."""
        proc = self.run(args, what)
        if proc.returncode != 0:
            raise self.failed(proc, what)
        return proc.stdout or ""


def _fetch(git: _Git, checkout: Path, source: GitSpec) -> None:
    """Fetch ``source.ref`` (HEAD if none) into ``checkout`` and check it out detached.

    The fetch is shallow (``--depth 1``). Fetching a commit by SHA shallowly needs a
    server that allows it (git's protocol v2 does, file:// included); when such a
    fetch is refused (protocol v0 without ``uploadpack.allowAnySHA1InWant``, an
    abbreviated SHA), every branch and tag is fetched in full and the commit is
    checked out from them.
    """
    c = str(checkout)
    ref = source.ref or "HEAD"
    what = f"fetching {ref}"
    shallow = ["-C", c, "fetch", "-q", "--depth", "1", "--no-recurse-submodules", "--no-tags"]
    proc = git.run([*shallow, "--", source.url, ref], what)
    target = "FETCH_HEAD"
    if proc.returncode != 0:
        if source.ref is None or not _HEX_REF.fullmatch(source.ref):
            raise git.failed(proc, what)
        refspecs = ["+refs/heads/*:refs/remotes/source/*", "+refs/tags/*:refs/tags/*"]
        full = ["-C", c, "fetch", "-q", "--no-recurse-submodules", "--no-tags"]
        git.check([*full, "--", source.url, *refspecs], "fetching the repository")
        # ^{commit}: the SHA must name a commit; --end-of-options keeps it an argument.
        found = git.run(
            ["-C", c, "rev-parse", "--verify", "-q", "--end-of-options", f"{ref}^{{commit}}"],
            f"finding commit {ref}",
        )
        if found.returncode != 0:
            # The shallow fetch's own words say best why the ref is unknown.
            raise git.failed(proc, what)
        target = found.stdout.strip()
    git.check(["-C", c, "checkout", "-q", "--detach", target], "checking out")


def _confined_directory(checkout: Path, source: GitSpec, spec: str, revision: str) -> Path:
    """The checkout's directory of env files, refused if it leads out of the checkout."""
    if not source.subdirectory:
        return checkout
    directory = checkout / source.subdirectory
    top = Path(os.path.realpath(checkout))
    real = Path(os.path.realpath(directory))
    if not _is_within(real, top):
        raise SourceError(
            f"subdirectory {source.subdirectory!r} of {spec} resolves outside the "
            f"checkout, to {real}",
            hint="point #subdirectory= at a real directory of the repository",
        )
    if not real.is_dir():
        raise SourceError(
            f"the repository has no directory {source.subdirectory!r} at {revision[:12]}",
            hint="check #subdirectory= against the repository at that ref",
        )
    return directory


@contextlib.contextmanager
def _git_source(spec: str, source: GitSpec) -> Iterator[EnvSource]:
    binary = _git_binary()
    tmp = make_private_dir("rootstock-src-")
    try:
        git = _Git(binary=binary, cwd=tmp, spec=spec)
        # A subdirectory: owner.json (the sweep's record) lives beside, not in, the tree.
        checkout = tmp / _CHECKOUT
        git.check(["init", "-q", "--", str(checkout)], "creating a repository")
        _fetch(git, checkout, source)
        revision = git.check(["-C", str(checkout), "rev-parse", "HEAD"], "reading the commit")
        revision = revision.strip()
        directory = _confined_directory(checkout, source, spec, revision)
        files = _env_files(directory, spec, confine_to=Path(os.path.realpath(checkout)))
        if not files:
            where = f"{source.subdirectory}/" if source.subdirectory else "the top level"
            raise SourceError(
                f"{spec} holds no env files (*.py) in {where} at {revision[:12]}",
                hint="add #subdirectory=DIR naming the directory of env files",
            )
        yield EnvSource(label=spec, kind="git", directory=directory, files=files, revision=revision)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def open_source(layout: InstallLayout, spec: str | None) -> Iterator[EnvSource]:
    """Open SOURCE ``spec`` (None: the registered sources) for the length of the context.

    A git SOURCE is checked out into a private temp dir, removed when the context
    exits, on an exception too. Raises :class:`UsageError` for a malformed spec
    (:func:`parse_source_spec`) and :class:`SourceError` for a SOURCE that cannot be
    read or fetched, that holds no env file, or whose subdirectory or env files are
    links leading out of a git checkout.
    """
    if spec is None:
        yield _registered_source(layout)
        return
    source = parse_source_spec(spec)
    if source is None:
        yield _directory_source(spec)
        return
    with _git_source(spec, source) as opened:
        yield opened
