"""What setup-perms and check-perms say when the machine or the root is not ready.

In-process through the CLI's ``main``: a missing root must read as one, and a
``PATH`` without ``setfacl`` must name the package that has it before anything runs.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
from pathlib import Path

import pytest

from rootstock.cli.main import main

pytestmark = pytest.mark.timeout(60)

GROUP_NAME = grp.getgrgid(os.getegid()).gr_name

# Everything the recipe runs except the acl package's programs.
_COREUTILS = ("mkdir", "chgrp", "chmod", "find", "ln", "touch", "rm", "mv", "cp")


def test_check_perms_on_a_missing_root_says_so(tmp_path: Path, capsys):
    root = tmp_path / "not-made-yet"
    assert main(["check-perms", str(root)]) == 1
    out = capsys.readouterr().out
    assert "None" not in out, out
    assert f"usage spool: not checked: the cache root {root} does not exist" in out
    assert f"rootstock setup-perms {root} --group GROUP --apply" in out

    assert main(["check-perms", str(root), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["usage_spool"] == {"path": str(root / "usage"), "target": None, "state": "unchecked"}
    # (Besides the 0700 temp dirs above it, which every user must traverse too.)
    assert ("missing", str(root)) in [(p["kind"], p["path"]) for p in doc["problems"]]


@pytest.fixture
def path_without_setfacl(tmp_path: Path, monkeypatch) -> Path:
    """A ``PATH`` of one directory holding the coreutils the recipe runs, and no setfacl."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in _COREUTILS:
        found = shutil.which(program)
        if found:
            (bin_dir / program).symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert shutil.which("setfacl") is None
    return bin_dir


def test_setup_perms_without_setfacl_names_the_acl_package(
    tmp_path: Path, path_without_setfacl: Path, capsys
):
    root = tmp_path / "shared" / "install"
    code = main(["setup-perms", str(root), "--group", GROUP_NAME, "--apply", "--yes"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "setfacl (package acl)" in err and "apt install acl" in err, err
    assert "nothing was changed" in err and "exit code 127" not in err
    assert "Traceback" not in err
    assert not (tmp_path / "shared").exists(), "no command may run before the check"

    # The dry run's script would stop at the first setfacl: it says so up front.
    assert main(["setup-perms", str(root), "--group", GROUP_NAME]) == 0
    out = capsys.readouterr().out
    assert "# note: setfacl (package acl) is not installed here" in out
    assert "apt install acl" in out
