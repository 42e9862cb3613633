"""The install's lock directory in the permission recipe and check: others get nothing.

A POSIX read lock needs only read access, so a ``.locks`` that others may enter
lets any user stall every maintainer's write. ``check-perms`` (both scopes) flags
it as ``locks-open``; ``setup-perms`` closes it again after its retrofit opened it.
"""

from __future__ import annotations

import grp
import os
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.install.perms import build_recipe
from rootstock.install.perms_check import check_perms

pytestmark = pytest.mark.timeout(60)

GROUP_NAME = grp.getgrgid(os.getegid()).gr_name


@pytest.mark.parametrize("full", [True, False], ids=["check-perms", "install-up-front"])
def test_an_open_lock_directory_is_a_problem_with_its_fix(tmp_path: Path, full: bool):
    root = tmp_path / "root"
    (root / ".locks").mkdir(parents=True)
    os.chmod(root / ".locks", 0o2775)
    layout = InstallLayout(root, root)
    (problem,) = [p for p in check_perms(layout, full=full).problems if p.kind == "locks-open"]
    assert problem.path == str(root / ".locks")
    assert "2775" in problem.message and "stalls" in problem.message
    assert problem.fix.startswith(f"chmod -R o-rwx {root / '.locks'}")
    os.chmod(root / ".locks", 0o2770)
    assert not [p for p in check_perms(layout, full=full).problems if p.kind == "locks-open"]


def test_the_recipe_closes_the_lock_directory_after_the_retrofit_opens_it(tmp_path: Path):
    root = tmp_path / "root"
    (root / ".locks").mkdir(parents=True)
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME, retrofit=True)
    argvs = [list(c.argv) for c in recipe.commands]
    close = ["chmod", "-R", "o-rwx", "--", str(root / ".locks")]
    assert close in argvs
    opens = [i for i, a in enumerate(argvs) if a[0] == "find" and "u+rwX,g+rwX,o+rX" in a]
    assert opens and max(opens) < argvs.index(close)
    assert recipe.commands[argvs.index(close)].phase == "mode"


def test_a_fresh_root_has_no_lock_directory_to_close(tmp_path: Path):
    root = tmp_path / "root"
    recipe = build_recipe(InstallLayout(root, root), GROUP_NAME)
    assert not any(str(root / ".locks") in c.argv for c in recipe.commands)
