"""The permission recipe as rendered: commands, their order, the spool variants.

No command runs here; ``tests/system/test_perms.py`` applies the recipe as root
with real users, groups and ACLs.
"""

from __future__ import annotations

import grp
import io
import os
import shlex
import stat
import struct
from pathlib import Path

import pytest

from rootstock.errors import UsageError
from rootstock.install.acl import GROUP, MASK, OTHER, USER, parse_acl
from rootstock.install.layout import InstallLayout
from rootstock.install.perms import (
    PHASES,
    USAGE_DISABLED_MARKER,
    PermsError,
    build_recipe,
    dir_acl,
    spool_default_acl,
)
from rootstock.install.perms_check import check_perms

pytestmark = pytest.mark.timeout(60)

GROUP_NAME = grp.getgrgid(os.getegid()).gr_name


def _argvs(recipe) -> list[list[str]]:
    return [list(c.argv) for c in recipe.commands]


def _runs(argv: list[str]) -> str:
    """The program a command really runs (find ... -exec PROGRAM counts as PROGRAM)."""
    return argv[argv.index("-exec") + 1] if argv[0] == "find" else argv[0]


def test_dry_run_lists_the_exact_commands(tmp_path: Path):
    root = tmp_path / "root"
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME)
    acl = f"u::rwx,g::rwx,g:{GROUP_NAME}:rwx,m::rwx,o::r-x"
    spool_acl = f"u::rwx,g::---,g:{GROUP_NAME}:rwx,m::rwx,o::---"
    r, uv, spool = str(root), str(root / ".uv-cache"), str(root / "usage")
    assert _argvs(recipe) == [
        ["mkdir", "-p", "--", r],
        ["mkdir", "-p", "--", uv],
        ["mkdir", "-p", "--", spool],
        ["chgrp", "--", GROUP_NAME, r],
        ["chgrp", "--", GROUP_NAME, uv],
        ["chgrp", "--", GROUP_NAME, spool],
        ["setfacl", "-m", acl, "--", r],
        ["setfacl", "-d", "-m", acl, "--", r],
        ["setfacl", "-m", acl, "--", uv],
        ["setfacl", "-d", "-m", acl, "--", uv],
        ["setfacl", "-d", "-m", spool_acl, "--", spool],
        ["chmod", "2775", "--", r],
        ["chmod", "2775", "--", uv],
        ["chmod", "1777", "--", spool],
    ]
    assert recipe.spool == root / "usage"
    assert not root.exists(), "building the recipe must change nothing"


@pytest.mark.parametrize("retrofit", [False, True], ids=["plain", "retrofit"])
def test_chmod_comes_after_every_setfacl(tmp_path: Path, retrofit: bool):
    root, cache = tmp_path / "root", tmp_path / "cache"
    (root / ".uv-cache" / "wheels").mkdir(parents=True)  # a populated cache: fixed in full
    recipe = build_recipe(InstallLayout(root, cache), GROUP_NAME, retrofit=retrofit)
    programs = [_runs(argv) for argv in _argvs(recipe)]
    last_acl = max(i for i, p in enumerate(programs) if p == "setfacl")
    first_chmod = min(i for i, p in enumerate(programs) if p == "chmod")
    assert last_acl < first_chmod
    assert programs[-1] == "chmod"
    phases = [c.phase for c in recipe.commands]
    assert phases == sorted(phases, key=PHASES.index)


def test_split_cache_root_and_uv_cache_are_covered(tmp_path: Path):
    root, cache = tmp_path / "root", tmp_path / "scratch" / "cache"
    recipe = build_recipe(InstallLayout(root, cache), GROUP_NAME)
    chmodded = [argv[-1] for argv in _argvs(recipe) if argv[:2] == ["chmod", "2775"]]
    assert chmodded == [str(root), str(root / ".uv-cache"), str(cache)]
    defaults = [a[-1] for a in _argvs(recipe) if a[:3] == ["setfacl", "-d", "-m"]]
    assert str(cache) in defaults and str(root / ".uv-cache") in defaults
    assert ["chmod", "1777", "--", str(cache / "usage")] in _argvs(recipe)


def test_usage_dir_makes_a_spool_elsewhere_and_links_it(tmp_path: Path):
    root, target = tmp_path / "root", tmp_path / "home" / "spool"
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME, usage_dir=target)
    argvs = _argvs(recipe)
    assert ["mkdir", "-p", "--", str(target)] in argvs
    assert ["ln", "-sfnT", "--", str(target), str(root / "usage")] in argvs
    assert ["chmod", "1777", "--", str(target)] in argvs
    assert ["setfacl", "-d", "-m", spool_default_acl(GROUP_NAME), "--", str(target)] in argvs
    assert ["mkdir", "-p", "--", str(root / "usage")] not in argvs
    assert recipe.spool == target
    assert any("o+x" in note for note in recipe.notes)


def test_usage_dir_replaces_an_empty_spool_but_never_a_populated_one(tmp_path: Path):
    root = tmp_path / "root"
    (root / "usage").mkdir(parents=True)
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME, usage_dir=tmp_path / "s")
    argvs = _argvs(recipe)
    assert argvs.index(["rmdir", "--", str(root / "usage")]) < argvs.index(
        ["ln", "-sfnT", "--", str(tmp_path / "s"), str(root / "usage")]
    )
    (root / "usage" / "record.json").write_text("{}")
    with pytest.raises(PermsError, match="already holds usage records"):
        build_recipe(InstallLayout(root, root), GROUP_NAME, usage_dir=tmp_path / "s")


def test_an_existing_spool_link_is_kept(tmp_path: Path):
    root, target = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    target.mkdir()
    (root / "usage").symlink_to(target)
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME)
    assert recipe.spool == target
    assert ["chmod", "1777", "--", str(target)] in _argvs(recipe)
    assert not any(a[0] in ("ln", "rmdir") for a in _argvs(recipe))


def test_no_usage_spool_records_the_choice(tmp_path: Path):
    root = tmp_path / "root"
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME, no_usage_spool=True)
    argvs = _argvs(recipe)
    marker = str(root / USAGE_DISABLED_MARKER)
    assert ["touch", "--", marker] in argvs
    assert ["chmod", "0664", "--", marker] in argvs
    assert not any(str(root / "usage") in a for a in argvs)
    assert not any("1777" in a for a in argvs)
    assert recipe.spool is None


def test_check_treats_a_missing_spool_as_a_choice_only_with_the_marker(tmp_path: Path):
    root = tmp_path / "root"
    root.mkdir()
    layout = InstallLayout(root, root)
    report = check_perms(layout)
    assert report.spool["state"] == "missing"
    assert [p.kind for p in report.problems if p.path == str(root / "usage")] == ["spool"]
    (root / USAGE_DISABLED_MARKER).touch()
    report = check_perms(layout)
    assert report.spool["state"] == "disabled"
    assert not [p for p in report.problems if p.kind == "spool"]


def test_check_flags_a_spool_that_is_not_1777(tmp_path: Path):
    root = tmp_path / "root"
    (root / "usage").mkdir(parents=True)
    os.chmod(root / "usage", 0o755)
    spool = [p for p in check_perms(InstallLayout(root, root)).problems if p.kind == "spool"]
    assert len(spool) == 1 and "chmod 1777" in spool[0].fix
    os.chmod(root / "usage", 0o1777)
    assert not [p for p in check_perms(InstallLayout(root, root)).problems if p.kind == "spool"]


def test_contradictory_or_unknown_options_are_usage_errors(tmp_path: Path):
    layout = InstallLayout(tmp_path, tmp_path)
    with pytest.raises(UsageError):
        build_recipe(layout, GROUP_NAME, usage_dir=tmp_path / "s", no_usage_spool=True)
    with pytest.raises(UsageError, match="no group"):
        build_recipe(layout, "no-such-group-rootstock")


def test_retrofit_walks_both_trees_and_skips_the_spool(tmp_path: Path):
    root, cache = tmp_path / "root", tmp_path / "cache"
    recipe = build_recipe(InstallLayout(root, cache), GROUP_NAME, retrofit=True)
    finds = [a for a in _argvs(recipe) if a[0] == "find"]
    assert {a[1] for a in finds} == {str(root), str(cache)}
    for argv in (a for a in finds if a[1] == str(cache)):
        assert argv[2:5] == ["-path", str(cache / "usage"), "-prune"]
    assert any(a[-4:] == ["chmod", "g+s", "{}", "+"] for a in finds)


def test_a_populated_uv_cache_is_fixed_in_full_without_retrofit(tmp_path: Path):
    root = tmp_path / "root"
    (root / ".uv-cache" / "archive-v0").mkdir(parents=True)
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME)
    finds = [a for a in _argvs(recipe) if a[0] == "find"]
    assert finds and {a[1] for a in finds} == {str(root / ".uv-cache")}


def test_script_is_a_runnable_shell_script(tmp_path: Path):
    root = tmp_path / "root with space"
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME)
    lines = recipe.script().splitlines()
    assert lines[0] == "umask 002"
    assert [shlex.split(line) for line in lines[1:]] == _argvs(recipe)


def test_apply_without_a_terminal_or_yes_refuses(tmp_path, monkeypatch, capsys):
    from rootstock.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    root = tmp_path / "root"
    code = main(["setup-perms", str(root), "--group", GROUP_NAME, "--apply"])
    assert code == 2
    assert "--yes" in capsys.readouterr().err
    assert not root.exists()


def test_dry_run_prints_the_script(tmp_path, capsys):
    from rootstock.cli.main import main

    root = tmp_path / "root"
    assert main(["setup-perms", str(root), "--group", GROUP_NAME]) == 0
    out = capsys.readouterr().out
    assert f"chmod 2775 -- {root}" in out and "dry run" in out
    assert not root.exists()


# --- the ordering bug, on a model of a filesystem that clears setgid on ACL writes -----


class _ClearsSetgidOnAclWrite:
    """The behaviour seen on NERSC CFS: every ACL write drops the setgid bit."""

    def __init__(self) -> None:
        self.mode: dict[str, int] = {}

    def run(self, argv: list[str]) -> None:
        program, path = _runs(argv), argv[-1]
        if program == "mkdir":
            self.mode.setdefault(path, 0o755)
        elif program == "setfacl":
            self.mode[path] &= ~stat.S_ISGID
        elif program == "chmod":
            self.mode[path] = int(argv[1], 8)


def test_chmod_last_survives_a_filesystem_that_clears_setgid(tmp_path: Path):
    root = tmp_path / "root"
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME)
    argvs = _argvs(recipe)
    fs = _ClearsSetgidOnAclWrite()
    for argv in argvs:
        fs.run(argv)
    assert fs.mode[str(root)] & stat.S_ISGID
    # The hand-rolled order (chmod first) loses it on such a filesystem.
    chmod_first = sorted(argvs, key=lambda a: {"chmod": 0, "setfacl": 1}.get(a[0], -1))
    fs = _ClearsSetgidOnAclWrite()
    for argv in chmod_first:
        fs.run(argv)
    assert not fs.mode[str(root)] & stat.S_ISGID


# --- reading ACLs from their xattrs ---------------------------------------------------


def test_parse_acl_reads_the_kernel_format():
    entries = [(0x01, 7, 0xFFFFFFFF), (USER, 6, 1234), (0x04, 5, 0xFFFFFFFF)]
    entries += [(GROUP, 7, 50), (MASK, 5, 0xFFFFFFFF), (OTHER, 5, 0xFFFFFFFF)]
    blob = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    acl = parse_acl(blob)
    assert acl.mask == 0o5 and acl.other == 0o5
    assert [e.qualifier for e in acl.named_users] == [1234]
    assert acl.group_perms(50) == 0o7 and acl.group_perms(51) is None
    with pytest.raises(ValueError):
        parse_acl(b"\x02\x00\x00\x00\x01")


def test_dir_acl_grants_the_group_and_world_read():
    assert dir_acl("proj") == "u::rwx,g::rwx,g:proj:rwx,m::rwx,o::r-x"
