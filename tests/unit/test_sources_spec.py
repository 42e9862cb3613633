"""SOURCE specs and the SOURCEs that need no git (ops/sources.py), in-process.

``parse_source_spec`` follows pip's ``git+URL[@REF][#subdirectory=DIR]`` and refuses
(exit code 2) anything git could read as an option. Directory and registered
SOURCEs list their env files, and every way of holding none is an error, never
"nothing declared". The git SOURCEs themselves run git: tests/integration/test_sources.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from rootstock.errors import RootstockError, SourceError, UsageError
from rootstock.install.layout import InstallLayout
from rootstock.ops import sources
from rootstock.ops.sources import EnvSource, GitSpec, open_source, parse_source_spec


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    root = tmp_path / "root"
    root.mkdir()
    return InstallLayout(root=root, cache_root=root)


def write(path: Path, text: str = "# env\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def refusal(
    layout: InstallLayout, spec: str | None, error: type[RootstockError], match: str | None = None
) -> RootstockError:
    """The error that opening ``spec`` raises (the test fails if it opens)."""
    with pytest.raises(error, match=match) as caught, open_source(layout, spec):
        pass
    return caught.value


# --- parse_source_spec -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            "git+https://github.com/org/envs.git@v1#subdirectory=environments",
            GitSpec("https://github.com/org/envs.git", "v1", "environments"),
        ),
        ("git+https://github.com/org/envs.git", GitSpec("https://github.com/org/envs.git")),
        # The user part's '@' is no ref separator; the last '@' of the path is.
        ("git+ssh://git@host/x.git@v1", GitSpec("ssh://git@host/x.git", "v1")),
        ("git+ssh://git@host/x.git", GitSpec("ssh://git@host/x.git")),
        (
            "git+ssh://git@host:2222/org/x.git@main",
            GitSpec("ssh://git@host:2222/org/x.git", "main"),
        ),
        # pip's rule lets a branch hold slashes.
        ("git+https://host/repo@release/1.0", GitSpec("https://host/repo", "release/1.0")),
        ("git+file:///srv/envs", GitSpec("file:///srv/envs")),
        (
            "git+file:///srv/envs@0123456789abcdef0123456789abcdef01234567#subdirectory=a/b",
            GitSpec("file:///srv/envs", "0123456789abcdef0123456789abcdef01234567", "a/b"),
        ),
        # Normalised to a plain relative path; pip's egg= is accepted and ignored.
        ("git+file:///r#subdirectory=./envs/", GitSpec("file:///r", None, "envs")),
        ("git+file:///r#egg=x&subdirectory=envs", GitSpec("file:///r", None, "envs")),
        ("git+https://user:token@host/r.git@v2", GitSpec("https://user:token@host/r.git", "v2")),
    ],
)
def test_git_specs_parse_like_pip(spec: str, expected: GitSpec) -> None:
    assert parse_source_spec(spec) == expected


@pytest.mark.parametrize("spec", ["./envs", "envs", "/srv/envs", "~/envs", "git", "gitlab/envs"])
def test_plain_directories_are_no_git_spec(spec: str) -> None:
    assert parse_source_spec(spec) is None


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        ("-rf", "starts with '-'"),
        ("--upload-pack=evil", "starts with '-'"),
        ("git+-oProxyCommand=touch%20/tmp/pwned", "URL '-oProxyCommand"),
        ("git+ssh://-oProxyCommand=evil/repo", "host '-oProxyCommand=evil'"),
        ("git+ssh://git@-oProxyCommand=evil/repo", "host '-oProxyCommand=evil'"),
        ("git+https://host/repo@--upload-pack=touch%20x", "ref '--upload-pack=touch%20x'"),
        ("git+file:///r@-b#subdirectory=envs", "ref '-b'"),
    ],
)
def test_a_leading_dash_is_refused(spec: str, what: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_source_spec(spec)
    assert what in caught.value.message
    assert caught.value.exit_code == 2
    assert caught.value.hint


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("git+", "no scheme"),
        ("git+host/repo", "no scheme"),
        ("git+://host/repo", "no scheme"),
        ("git+https://", "no host"),
        ("git+https:///repo", "no host"),
        ("git+https://host", "names no repository"),
        ("git+https://host/", "names no repository"),
        ("git+file://", "names no repository"),
        ("git+https://host/repo@", "nothing follows '@'"),
        ("git+ext::sh", "no scheme"),
        ("git+ext://sh/x", "transport 'ext'"),
        ("git+fd://3/x", "transport 'fd'"),
        ("git+https://host/my repo", "whitespace"),
        ("git+https://host/repo\n", "whitespace"),
        ("git+https://host/re\x01po", "control character"),
        ("git+file:///r#subdirectory=../x", "climbs out"),
        ("git+file:///r#subdirectory=envs/../../x", "climbs out"),
        ("git+file:///r#subdirectory=/etc", "absolute"),
        ("git+file:///r#subdirectory=", "not a plain relative path"),
        ("git+file:///r#subdirectory=a\\..\\b", "not a plain relative path"),
        ("git+file:///r#subdirectory=.", "names the repository itself"),
        ("git+file:///r#subdirectory", "not KEY=VALUE"),
        ("git+file:///r#subdirectory=a&subdirectory=b", "given twice"),
        ("git+file:///r#branch=main", "unknown fragment key 'branch'"),
    ],
)
def test_malformed_git_specs_are_usage_errors(spec: str, why: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_source_spec(spec)
    assert why in caught.value.message
    assert "git+URL[@REF][#subdirectory=DIR]" in (caught.value.hint or "")


def test_an_empty_spec_is_refused() -> None:
    with pytest.raises(UsageError, match="empty"):
        parse_source_spec("")


# --- directory SOURCEs -------------------------------------------------------------------


def test_a_directory_lists_its_env_files_only(tmp_path: Path, layout: InstallLayout) -> None:
    src = tmp_path / "envs"
    write(src / "b.py")
    write(src / "a.py")
    write(src / "a.py.lock", "lock\n")
    write(src / "notes.txt")
    write(src / ".#a.py", "an editor's lock file\n")
    write(src / "nested" / "c.py")  # no recursion
    (src / "pkg.py").mkdir()  # a directory is no env file
    with open_source(layout, str(src)) as opened:
        assert opened == EnvSource(
            label=str(src), kind="dir", directory=src, files=[src / "a.py", src / "b.py"]
        )
        assert opened.to_dict() == {
            "label": str(src),
            "kind": "dir",
            "directory": str(src),
            "files": ["a.py", "b.py"],
            "revision": None,
        }


def test_a_relative_directory_keeps_the_label_given(
    tmp_path: Path, layout: InstallLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "envs" / "emt.py")
    monkeypatch.chdir(tmp_path)
    with open_source(layout, "./envs") as opened:
        assert opened.label == "./envs"
        assert opened.directory == tmp_path / "envs"  # absolute: --json needs no cwd
        assert [p.name for p in opened.files] == ["emt.py"]
        assert opened.files[0].read_text() == "# env\n"


def test_symlinks_of_a_plain_directory_may_point_anywhere(
    tmp_path: Path, layout: InstallLayout
) -> None:
    real = write(tmp_path / "elsewhere" / "real.py", "# the real one\n")
    src = tmp_path / "envs"
    src.mkdir()
    (src / "emt.py").symlink_to(real)
    with open_source(layout, str(src)) as opened:
        assert opened.files == [src / "emt.py"]


def test_a_broken_symlink_is_an_error(tmp_path: Path, layout: InstallLayout) -> None:
    src = tmp_path / "envs"
    write(src / "ok.py")
    (src / "gone.py").symlink_to(tmp_path / "nowhere.py")
    refusal(layout, str(src), SourceError, match=r"gone\.py is a broken symlink")


def test_a_missing_directory_names_the_path(tmp_path: Path, layout: InstallLayout) -> None:
    missing = tmp_path / "no-such-envs"
    caught = refusal(layout, str(missing), SourceError)
    assert str(missing) in caught.message
    assert "does not exist" in caught.message
    assert "nothing" not in caught.message


def test_a_file_is_not_a_directory(tmp_path: Path, layout: InstallLayout) -> None:
    env_file = write(tmp_path / "emt.py")
    caught = refusal(layout, str(env_file), SourceError)
    assert caught.message == f"SOURCE {env_file} is a file, not a directory"
    assert "rootstock install FILE" in (caught.hint or "")


@pytest.mark.parametrize("contents", [[], ["README.md", "x.py.lock", ".hidden.py"]])
def test_a_directory_without_env_files_is_an_error(
    tmp_path: Path, layout: InstallLayout, contents: list[str]
) -> None:
    src = tmp_path / "envs"
    src.mkdir()
    for name in contents:
        write(src / name)
    caught = refusal(layout, str(src), SourceError, match=r"holds no env files \(\*\.py\)")
    assert str(src) in caught.message
    assert caught.exit_code == 1


def test_an_unreadable_env_file_is_named(
    tmp_path: Path, layout: InstallLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "envs"
    write(src / "a.py")
    locked = write(src / "b.py")
    real_open = open

    def refusing_open(path: object, *args: object, **kwargs: object) -> object:
        if Path(str(path)) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    # The module's own name shadows the builtin: root reads every file, whatever its mode.
    monkeypatch.setattr(sources, "open", refusing_open, raising=False)
    caught = refusal(layout, str(src), SourceError)
    assert caught.message == f"cannot read env file {locked}: Permission denied"


def test_an_unlistable_directory(
    tmp_path: Path, layout: InstallLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Refused by the listing itself, as a mode 0300 directory refuses any user but root.
    src = tmp_path / "envs"
    write(src / "a.py")
    real_listdir = os.listdir

    def refusing_listdir(path: object) -> list[str]:
        if Path(str(path)) == src:
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(sources.os, "listdir", refusing_listdir)
    refusal(layout, str(src), SourceError, match=re.escape(f"cannot list SOURCE directory {src}"))


# --- the registered SOURCE ---------------------------------------------------------------


def test_the_registered_sources(layout: InstallLayout) -> None:
    registered = layout.environments_dir
    write(registered / "mace.py")
    write(registered / "emt.py")
    write(registered / "emt.py.lock", "lock\n")
    write(registered / "mace.py.lock", "lock\n")
    with open_source(layout, None) as opened:
        assert opened.kind == "registered"
        assert opened.label == f"registered sources in {registered}"
        assert opened.directory == registered
        assert opened.files == [registered / "emt.py", registered / "mace.py"]
        assert opened.revision is None


@pytest.mark.parametrize("state", ["no environments dir", "only lockfiles", "empty"])
def test_no_registered_sources_is_an_error(layout: InstallLayout, state: str) -> None:
    if state != "no environments dir":
        layout.environments_dir.mkdir()
    if state == "only lockfiles":
        write(layout.environments_dir / "emt.py.lock", "lock\n")
    caught = refusal(layout, None, SourceError)
    assert caught.message == f"no registered env files in {layout.environments_dir}"
    assert "rootstock install" in (caught.hint or "")
    assert "SOURCE" in (caught.hint or "")


# --- git, before any git runs ------------------------------------------------------------


def test_git_missing_from_path(
    tmp_path: Path, layout: InstallLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    caught = refusal(layout, "git+file:///srv/envs@main", SourceError)
    assert "cannot find the git executable" in caught.message
    assert "install git" in (caught.hint or "")


@pytest.mark.parametrize(("spec", "match"), [("", "empty"), ("-envs", "starts with '-'")])
def test_open_source_refuses_what_parse_refuses(
    layout: InstallLayout, spec: str, match: str
) -> None:
    caught = refusal(layout, spec, UsageError, match=match)
    assert caught.exit_code == 2


def test_a_malformed_git_spec_is_refused_by_open_source(layout: InstallLayout) -> None:
    refusal(layout, "git+file:///srv/envs#subdirectory=../x", UsageError, match="climbs out")


def test_the_git_environment_drops_the_callers_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_DIR", "/elsewhere/.git")
    monkeypatch.setenv("GIT_WORK_TREE", "/elsewhere")
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "core.sshCommand")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "evil")
    monkeypatch.setenv("GIT_SSH_COMMAND", "ssh -i /keys/deploy")
    monkeypatch.setenv("GIT_TERMINAL_PROMPT", "1")
    env = sources.git_environment()
    for gone in ("GIT_DIR", "GIT_WORK_TREE", "GIT_CONFIG_COUNT", "GIT_CONFIG_KEY_0"):
        assert gone not in env
    assert env["GIT_SSH_COMMAND"] == "ssh -i /keys/deploy"  # how to reach the server stays
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    assert env["GIT_CONFIG_NOSYSTEM"] == "1"
    assert env["GIT_ALLOW_PROTOCOL"] == "file:https:http:ssh:git"
    assert env["PATH"] == os.environ["PATH"]
