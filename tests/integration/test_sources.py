"""git SOURCEs (ops/sources.py) against a real repository made by git in tmp.

The repository's history makes every way of naming a commit give different env
files: tag ``v1`` (a.py, its first version), a commit no branch or tag points at
(a.py changed, b.py), branch ``release`` (c.py added) and ``main`` (d.py, and an
``envs/`` subdirectory). Side branches hold a submodule and symlinks leading out.
Each test gets a private ``$TMPDIR``, so the checkout's temp dir can be watched
coming and going, and no other test's directories are in reach of the sweep.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.errors import RootstockError, SourceError, UsageError
from rootstock.install.layout import InstallLayout
from rootstock.ops import sources
from rootstock.ops.sources import EnvSource, open_source

pytestmark = [pytest.mark.timeout(300)]

IDENTITY = {
    "GIT_AUTHOR_NAME": "Rootstock Test",
    "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "Rootstock Test",
    "GIT_COMMITTER_EMAIL": "test@example.invalid",
}


class Repo:
    """A repository on disk and the commits the tests name."""

    def __init__(self, path: Path, home: Path) -> None:
        self.path = path
        self.env = {**os.environ, **IDENTITY, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}
        self.commits: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"git+file://{self.path}"

    def git(self, *args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(self.path), *args],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()

    def write(self, name: str, text: str) -> None:
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def commit(self, label: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", label)
        self.commits[label] = self.git("rev-parse", "HEAD")
        return self.commits[label]


def make_repo(top: Path) -> Repo:
    home = top / "home"
    home.mkdir()
    path = top / "repo"
    subprocess.run(
        ["git", "init", "-q", "-b", "main", str(path)],
        check=True,
        env={**os.environ, "HOME": str(home)},
        timeout=60,
    )
    repo = Repo(path, home)
    repo.write("a.py", "A1\n")
    repo.write("README.md", "env files\n")
    repo.commit("c1")
    repo.git("tag", "v1")
    repo.git("tag", "-a", "-m", "the first", "v1-annotated")
    repo.write("a.py", "A2\n")
    repo.write("b.py", "B\n")
    repo.commit("c2")  # named by its SHA only
    repo.write("c.py", "C\n")
    repo.commit("c3")
    repo.git("branch", "release")
    repo.write("d.py", "D\n")
    repo.write("envs/sub1.py", "S1\n")
    repo.write("envs/notes.txt", "not an env file\n")
    repo.write("docs/guide.md", "no env file here\n")
    repo.commit("c4")

    # A repository for the submodule, and a branch that holds it.
    sub = Repo(top / "subrepo", home)
    subprocess.run(["git", "init", "-q", "-b", "main", str(sub.path)], check=True, timeout=60)
    sub.write("x.py", "X\n")
    sub.commit("s1")
    repo.git("checkout", "-q", "-b", "with-sub", "main")
    repo.git(
        "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub.path), "vendored"
    )
    repo.commit("with-sub")

    outside = top / "outside"
    outside.mkdir()
    (outside / "stolen.py").write_text("from outside\n")
    repo.git("checkout", "-q", "-b", "links", "main")
    (repo.path / "shared").mkdir()
    (repo.path / "shared" / "real.py").write_text("REAL\n")
    (repo.path / "envs" / "alias.py").symlink_to("../shared/real.py")
    repo.commit("links")
    repo.git("checkout", "-q", "-b", "escape-file", "main")
    (repo.path / "envs" / "evil.py").symlink_to(outside / "stolen.py")
    repo.commit("escape-file")
    repo.git("checkout", "-q", "-b", "escape-dir", "main")
    (repo.path / "outlink").symlink_to(outside)
    (repo.path / "uplink").symlink_to("..")
    repo.commit("escape-dir")
    repo.git("checkout", "-q", "main")
    return repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Repo:
    return make_repo(tmp_path_factory.mktemp("git-source"))


@pytest.fixture
def tmpdir_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short private ``$TMPDIR`` (the checkout goes there), emptied afterwards."""
    base = Path(tempfile.mkdtemp(prefix="src-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    root = tmp_path / "root"
    root.mkdir()
    return InstallLayout(root=root, cache_root=root)


def checkouts(base: Path) -> list[Path]:
    return sorted(base.glob("rootstock-src-*"))


def refusal(
    layout: InstallLayout, spec: str, error: type[RootstockError], match: str | None = None
) -> RootstockError:
    """The error that opening ``spec`` raises (the test fails if it opens)."""
    with pytest.raises(error, match=match) as caught, open_source(layout, spec):
        pass
    return caught.value


def contents(opened: EnvSource) -> dict[str, str]:
    return {p.name: p.read_text() for p in opened.files}


def recording_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """Put a ``git`` first on PATH that leaves a mark, then runs ``body`` (sh)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "git-ran"
    script = bin_dir / "git"
    script.write_text(f'#!/bin/sh\necho "$$ $*" >> {mark}\n{body}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return mark


def real_git() -> str:
    found = subprocess.run(
        ["sh", "-c", "command -v git"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    return found


# --- branch, tag, SHA, subdirectory ------------------------------------------------------


ALL = {"a.py": "A2\n", "b.py": "B\n", "c.py": "C\n", "d.py": "D\n"}


@pytest.mark.parametrize(
    ("ref", "commit", "expected", "shallow"),
    [
        ("@main", "c4", ALL, True),
        ("", "c4", ALL, True),
        ("@release", "c3", {"a.py": "A2\n", "b.py": "B\n", "c.py": "C\n"}, True),
        ("@v1", "c1", {"a.py": "A1\n"}, True),
        ("@v1-annotated", "c1", {"a.py": "A1\n"}, True),  # the commit, not the tag object
        ("@<c2>", "c2", {"a.py": "A2\n", "b.py": "B\n"}, True),
        # An abbreviated SHA cannot be fetched shallowly: the full-fetch fallback.
        ("@<c2:10>", "c2", {"a.py": "A2\n", "b.py": "B\n"}, False),
    ],
)
def test_each_ref_gives_its_own_files(
    repo: Repo,
    layout: InstallLayout,
    tmpdir_base: Path,
    ref: str,
    commit: str,
    expected: dict[str, str],
    shallow: bool,
) -> None:
    if ref.startswith("@<"):
        name, _, length = ref[2:-1].partition(":")
        sha = repo.commits[name]
        ref = "@" + (sha[: int(length)] if length else sha)
    spec = repo.url + ref
    with open_source(layout, spec) as opened:
        assert opened.kind == "git"
        assert opened.label == spec
        assert opened.revision == repo.commits[commit]
        assert contents(opened) == expected
        assert [p.name for p in opened.files] == sorted(expected)
        assert opened.to_dict()["files"] == sorted(expected)
        assert opened.to_dict()["revision"] == repo.commits[commit]
        top = opened.directory
        history = subprocess.run(
            ["git", "-C", str(top), "rev-list", "--count", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        # Shallow: the checkout holds that one commit, none of its parents.
        assert (history == "1") is shallow
        # The checkout lives in a private dir of its own, under $TMPDIR.
        [made] = checkouts(tmpdir_base)
        assert made in top.parents
        assert stat.S_IMODE(made.stat().st_mode) == 0o700
        assert (made / "owner.json").is_file()
    assert checkouts(tmpdir_base) == []


def test_a_subdirectory(repo: Repo, layout: InstallLayout, tmpdir_base: Path) -> None:
    spec = f"{repo.url}@main#subdirectory=envs"
    with open_source(layout, spec) as opened:
        assert opened.directory.name == "envs"
        assert contents(opened) == {"sub1.py": "S1\n"}
        assert opened.revision == repo.commits["c4"]
        assert opened.to_dict()["directory"] == str(opened.directory)
    assert checkouts(tmpdir_base) == []


def test_a_subdirectory_the_ref_lacks(repo: Repo, layout: InstallLayout, tmpdir_base: Path) -> None:
    refusal(
        layout,
        f"{repo.url}@release#subdirectory=envs",
        SourceError,
        match="the repository has no directory 'envs'",
    )
    assert checkouts(tmpdir_base) == []


def test_a_subdirectory_that_is_a_file(
    repo: Repo, layout: InstallLayout, tmpdir_base: Path
) -> None:
    spec = f"{repo.url}@main#subdirectory=envs/notes.txt"
    refusal(layout, spec, SourceError, match="the repository has no directory 'envs/notes.txt'")
    assert checkouts(tmpdir_base) == []


def test_no_env_files_is_an_error(repo: Repo, layout: InstallLayout, tmpdir_base: Path) -> None:
    spec = f"{repo.url}@main#subdirectory=docs"
    refusal(
        layout, spec, SourceError, match=r"holds no env files \(\*\.py\) in docs/ at [0-9a-f]{12}"
    )
    assert checkouts(tmpdir_base) == []


def test_the_temp_dir_goes_on_an_exception(
    repo: Repo, layout: InstallLayout, tmpdir_base: Path
) -> None:
    seen: list[EnvSource] = []
    with (
        pytest.raises(RuntimeError, match="inside the context"),
        open_source(layout, f"{repo.url}@v1") as opened,
    ):
        seen.append(opened)
        assert opened.directory.is_dir()
        assert checkouts(tmpdir_base)
        raise RuntimeError("inside the context")
    assert seen
    assert checkouts(tmpdir_base) == []
    assert not opened.directory.exists()


def test_the_callers_git_variables_do_not_leak(
    repo: Repo, layout: InstallLayout, tmpdir_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GIT_DIR", str(repo.path / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(repo.path))
    with open_source(layout, f"{repo.url}@v1") as opened:
        assert contents(opened) == {"a.py": "A1\n"}
    # The repository the caller's variables named is untouched (no detached HEAD there).
    assert repo.git("symbolic-ref", "HEAD") == "refs/heads/main"


# --- what is never fetched or followed ---------------------------------------------------


def test_submodules_are_not_fetched(
    repo: Repo,
    layout: InstallLayout,
    tmpdir_base: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A user config that would fetch and check out submodules, were it obeyed.
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        # active = .: every submodule counts as wanted, so a recursing checkout acts on it.
        "[submodule]\n\trecurse = true\n\tactive = .\n[fetch]\n\trecurseSubmodules = true\n"
        '[protocol "file"]\n\tallow = always\n'
    )
    monkeypatch.setenv("HOME", str(home))
    with open_source(layout, f"{repo.url}@with-sub") as opened:
        assert opened.revision == repo.commits["with-sub"]
        vendored = opened.directory / "vendored"
        assert vendored.is_dir()
        assert list(vendored.iterdir()) == []
        assert (opened.directory / ".gitmodules").is_file()
        git_dir = opened.directory / ".git"
        assert not (git_dir / "modules").exists()
    assert checkouts(tmpdir_base) == []


def test_a_symlink_inside_the_checkout_is_followed(
    repo: Repo, layout: InstallLayout, tmpdir_base: Path
) -> None:
    with open_source(layout, f"{repo.url}@links#subdirectory=envs") as opened:
        assert contents(opened) == {"alias.py": "REAL\n", "sub1.py": "S1\n"}


def test_an_env_file_linking_outside_is_refused(
    repo: Repo, layout: InstallLayout, tmpdir_base: Path
) -> None:
    refusal(
        layout,
        f"{repo.url}@escape-file#subdirectory=envs",
        SourceError,
        match=r"env file evil\.py .* is a symlink to .*outside",
    )
    assert checkouts(tmpdir_base) == []


@pytest.mark.parametrize("subdirectory", ["outlink", "uplink", "uplink/repo"])
def test_a_subdirectory_linking_outside_is_refused(
    repo: Repo, layout: InstallLayout, tmpdir_base: Path, subdirectory: str
) -> None:
    spec = f"{repo.url}@escape-dir#subdirectory={subdirectory}"
    refusal(layout, spec, SourceError, match="resolves outside the checkout")
    assert checkouts(tmpdir_base) == []


def test_a_climbing_subdirectory_is_refused_before_git_runs(
    repo: Repo,
    layout: InstallLayout,
    tmpdir_base: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mark = recording_git(tmp_path, monkeypatch, f'exec {real_git()} "$@"')
    refusal(layout, f"{repo.url}@main#subdirectory=../x", UsageError, match="climbs out")
    assert not mark.exists()
    assert checkouts(tmpdir_base) == []


# --- git failing, and specs git must never see -------------------------------------------


def test_a_bad_ref_gives_gits_message(repo: Repo, layout: InstallLayout, tmpdir_base: Path) -> None:
    caught = refusal(layout, f"{repo.url}@no-such-branch", SourceError)
    assert "git failed while fetching no-such-branch" in caught.message
    assert "couldn't find remote ref no-such-branch" in caught.message
    assert "check the URL and the ref" in (caught.hint or "")
    assert checkouts(tmpdir_base) == []


def test_a_bad_sha_gives_gits_message(repo: Repo, layout: InstallLayout, tmpdir_base: Path) -> None:
    refusal(layout, f"{repo.url}@deadbeef", SourceError, match=r"git failed while .*deadbeef")
    assert checkouts(tmpdir_base) == []


def test_a_missing_repository_gives_gits_message(
    tmp_path: Path, layout: InstallLayout, tmpdir_base: Path
) -> None:
    missing = tmp_path / "no-such-repo"
    caught = refusal(layout, f"git+file://{missing}@main", SourceError)
    assert "git failed while fetching main" in caught.message
    assert "does not appear to be a git repository" in caught.message
    assert checkouts(tmpdir_base) == []


@pytest.mark.parametrize(
    "spec",
    [
        "git+-oProxyCommand=touch%20/tmp/pwned/x",
        "git+ssh://-oProxyCommand=touch%20pwned/repo",
        "git+file:///srv/repo@--upload-pack=touch%20pwned",
        "git+file:///srv/repo@-b",
        "--upload-pack=touch",
    ],
)
def test_dash_specs_never_reach_git(
    repo: Repo,
    layout: InstallLayout,
    tmpdir_base: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    spec: str,
) -> None:
    mark = recording_git(tmp_path, monkeypatch, f'exec {real_git()} "$@"')
    # The recorder does record: a good spec runs it.
    with open_source(layout, f"{repo.url}@v1") as opened:
        assert contents(opened) == {"a.py": "A1\n"}
    assert "fetch" in mark.read_text()
    mark.unlink()
    refusal(layout, spec, UsageError, match="starts with '-'")
    assert not mark.exists()
    assert checkouts(tmpdir_base) == []


def test_every_url_and_ref_follows_a_double_dash(
    repo: Repo,
    layout: InstallLayout,
    tmpdir_base: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mark = recording_git(tmp_path, monkeypatch, f'exec {real_git()} "$@"')
    with open_source(layout, f"{repo.url}@v1"):
        pass
    calls = [line.split(" ", 1)[1] for line in mark.read_text().splitlines()]
    fetches = [c for c in calls if " fetch " in f" {c} "]
    assert fetches
    for call in fetches:
        assert f"-- file://{repo.path} v1" in call
        assert "--depth 1" in call and "--no-recurse-submodules" in call
    assert not any("submodule update" in c for c in calls)


def test_a_git_that_hangs_is_ended(
    layout: InstallLayout, tmpdir_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mark = recording_git(tmp_path, monkeypatch, "exec sleep 120")
    monkeypatch.setattr(sources, "GIT_TIMEOUT_S", 1.0)
    started = time.monotonic()
    caught = refusal(
        layout, "git+file:///srv/repo@main", SourceError, match="git timed out after 1 s"
    )
    assert time.monotonic() - started < 30
    assert "network" in (caught.hint or "")
    pid = int(mark.read_text().split()[0])  # sleep kept the shell's pid
    assert not running(pid)
    assert checkouts(tmpdir_base) == []


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, awaiting its reaper, does not)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return raw[raw.rindex(b")") + 2 :].split()[0] != b"Z"


def test_a_killed_reader_leaves_no_git_and_its_dir_is_swept(
    repo: Repo,
    layout: InstallLayout,
    tmpdir_base: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mark = recording_git(tmp_path, monkeypatch, "exec sleep 120")
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from pathlib import Path\n"
            "from rootstock.install.layout import InstallLayout\n"
            "from rootstock.ops.sources import open_source\n"
            "root = Path(sys.argv[1])\n"
            "with open_source(InstallLayout(root, root), 'git+file:///srv/repo@main'):\n"
            "    pass\n",
            str(layout.root),
        ],
        env=os.environ.copy(),  # the recording git first on PATH, our $TMPDIR
    )
    git_pid: int | None = None
    try:
        deadline = time.monotonic() + 60
        while git_pid is None and time.monotonic() < deadline:
            if mark.exists() and mark.read_text().strip():
                git_pid = int(mark.read_text().split()[0])
            else:
                time.sleep(0.05)
        assert git_pid is not None, "the reader never ran git"
        [left] = checkouts(tmpdir_base)
        reader.kill()
        reader.wait(timeout=30)
        # The lifeline's end takes git down, though nobody could tell it to stop.
        deadline = time.monotonic() + 30
        while running(git_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(git_pid)
        assert left.is_dir()  # a SIGKILL removes nothing; the next reader sweeps it
        monkeypatch.setenv("PATH", os.environ["PATH"].split(os.pathsep, 1)[1])
        with open_source(layout, f"{repo.url}@v1") as opened:
            assert not left.exists()
            assert checkouts(tmpdir_base) == [opened.directory.parent]
        assert checkouts(tmpdir_base) == []
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=30)
        if git_pid is not None and running(git_pid):
            os.kill(git_pid, signal.SIGKILL)
