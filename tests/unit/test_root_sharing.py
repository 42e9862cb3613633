"""A private root is not a broken shared root (issue #31, item 2).

Only a shared root draws the permission warning of ``install``, ``add`` and
``sync``, and then as one summary line; ``check-perms`` still reports everything.
``layout.json`` records the choice (``init --shared/--private``, ``setup-perms``);
a file without it is read from the root's mode and the cluster registry.
In-process through the CLI's ``main``, on roots under the test's temp dir.
"""

from __future__ import annotations

import grp
import json
import os
from pathlib import Path

import pytest

from rootstock.cli.main import main
from rootstock.errors import LayoutError
from rootstock.install import sharing
from rootstock.install.layout import InstallLayout, read_layout, write_layout
from rootstock.install.perms_check import PermProblem, PermReport, check_perms
from rootstock.install.sharing import root_is_shared
from rootstock.ops import perms as perms_ops
from rootstock.ops.init import InitRequest, init_root
from rootstock.ops.perms import CommandRun, apply_setup, plan_setup

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("private_config")]

GROUP_NAME = grp.getgrgid(os.getegid()).gr_name
SUMMARY = "permission problems make this root unusable by others; run rootstock check-perms"


def run(capsys: pytest.CaptureFixture, *argv: str | Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def quick_problems(root: Path) -> int:
    """How many problems install's up-front check finds on ``root`` (ACL support varies)."""
    return len(check_perms(InstallLayout(root, root), full=False).problems)


@pytest.fixture
def private_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    init_root(InitRequest(root=root, cluster="box"))
    return root


# --- a private root: no warnings ------------------------------------------------------


def test_private_root_install_and_add_start_with_the_error(private_root: Path, capsys):
    assert quick_problems(private_root) > 0, "the root must have something to warn about"

    code, _, err = run(capsys, "add", "emtt", "--root", private_root, "--no-push")
    assert code == 2, err
    assert not warnings_in(err), err
    assert err.startswith("error: unknown checkpoint 'emtt'"), err

    missing = private_root.parent / "nosuchenv.py"  # a path: checked after the perm check
    code, _, err = run(capsys, "install", missing, "--root", private_root, "--no-push")
    assert code == 1, err
    assert not warnings_in(err), err
    assert err.startswith(f"error: env file {missing} does not exist"), err
    assert read_layout(private_root)["shared"] is False  # the default under a temp dir


# --- a shared root: one summary line --------------------------------------------------


def _recorded(root: Path, monkeypatch) -> None:
    init_root(InitRequest(root=root, cluster="box", shared=True))


def _group_writable(root: Path, monkeypatch) -> None:
    init_root(InitRequest(root=root, cluster="box"))
    write_layout(root, None)  # a layout.json from before the field: read from the mode
    os.chmod(root, 0o775)
    # The group holds someone besides the owner (not the owner's private group).
    monkeypatch.setattr(sharing, "_owners_own_group", lambda uid, gid: False)


def _world_writable(root: Path, monkeypatch) -> None:
    init_root(InitRequest(root=root, cluster="box"))
    write_layout(root, None)
    os.chmod(root, 0o777)


def _registered(root: Path, monkeypatch) -> None:
    init_root(InitRequest(root=root, cluster="box"))
    write_layout(root, None)
    os.chmod(root, 0o755)
    registry = root.parent / "clusters.toml"
    registry.write_text(f'[clusters.box]\nroot = "{root}"\n')
    monkeypatch.setenv("ROOTSTOCK_CLUSTERS_FILE", str(registry))


@pytest.mark.parametrize(
    "make", [_recorded, _group_writable, _world_writable, _registered], ids=lambda f: f.__name__
)
def test_shared_root_gets_one_summary_line(tmp_path: Path, monkeypatch, capsys, make):
    root = tmp_path / "root"
    make(root, monkeypatch)
    assert root_is_shared(InstallLayout(root, root))
    count = quick_problems(root)
    assert count > 1

    code, _, err = run(capsys, "add", "emtt", "--root", root, "--no-push")
    assert code == 2, err
    assert warnings_in(err) == [f"warning: {count} {SUMMARY} {root} for details"], err
    assert err.splitlines()[1].startswith("error: unknown checkpoint 'emtt'"), err

    code, _, err = run(capsys, "add", "emtt", "--root", root, "--no-push", "--no-perm-check")
    assert not warnings_in(err), err


def test_one_problem_is_singular(private_root: Path, monkeypatch, capsys):
    one = PermReport(private_root, private_root, None, problems=[PermProblem("k", "p", "m", "f")])
    monkeypatch.setattr(perms_ops, "problems_for_others", lambda layout: one)
    _, _, err = run(capsys, "add", "emtt", "--root", private_root, "--no-push")
    assert warnings_in(err) == [
        "warning: 1 permission problem makes this root unusable by others; "
        f"run rootstock check-perms {private_root} for details"
    ], err


def test_check_perms_still_reports_every_problem_on_a_private_root(private_root: Path, capsys):
    report = check_perms(InstallLayout(private_root, private_root), full=True)
    code, out, _ = run(capsys, "check-perms", private_root)
    assert code == 1
    assert f"{len(report.problems)} problem(s) in {report.checked} paths checked:" in out
    for problem in report.problems:
        assert f"  {problem.path}: {problem.message}\n    fix: {problem.fix}\n" in out


# --- recording the choice -------------------------------------------------------------


def test_init_records_shared_or_private(tmp_path: Path, capsys):
    shared, private = tmp_path / "shared", tmp_path / "private"
    code, out, _ = run(capsys, "init", "--root", shared, "--cluster", "box", "--shared", "--yes")
    assert code == 0 and "shared:       yes" in out
    assert read_layout(shared)["shared"] is True
    code, out, _ = run(capsys, "init", "--root", private, "--cluster", "box", "--private")
    assert code == 0 and "shared:       no (private)" in out
    assert read_layout(private)["shared"] is False

    # --force changes it, keeping the rest of layout.json, and says so.
    code, out, _ = run(capsys, "init", "--root", private, "--force", "--shared", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["shared"] is True
    assert "the root is now recorded as shared (layout.json)" in doc["notes"]
    assert read_layout(private)["cache_root"] is None and read_layout(private)["shared"] is True


def test_init_default_outside_home_and_temp_is_shared_and_says_so(
    tmp_path: Path, monkeypatch, capsys
):
    monkeypatch.setattr(sharing, "personal_places", lambda: [])  # as if under /projects
    root = tmp_path / "root"
    code, _, err = run(capsys, "init", "--root", root, "--cluster", "box", "--yes")
    assert code == 0, err
    assert read_layout(root)["shared"] is True
    assert f"note: recorded {root} as shared (outside your home directory" in err
    assert "`rootstock init --force --private`" in err


def test_init_default_on_a_root_setup_perms_made_is_shared(tmp_path: Path):
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o2775)  # what setup-perms leaves before init
    assert init_root(InitRequest(root=root, cluster="box")).shared
    assert read_layout(root)["shared"] is True


def test_old_layout_without_the_field_still_works(tmp_path: Path, capsys):
    root = tmp_path / "root"
    init_root(InitRequest(root=root, cluster="box"))
    write_layout(root, None)  # as written before the field existed
    assert "shared" not in read_layout(root)
    layout = InstallLayout(root, root)
    os.chmod(root, 0o755)
    assert not root_is_shared(layout)
    _, _, err = run(capsys, "add", "emtt", "--root", root, "--no-push")
    assert err.startswith("error: unknown checkpoint 'emtt'"), err
    os.chmod(root, 0o2755)  # setup-perms ran
    assert root_is_shared(layout)
    os.chmod(root, 0o755)

    (root / "layout.json").write_text('{"layout_version": 1, "cache_root": null, "shared": "yes"}')
    with pytest.raises(LayoutError, match="shared must be true or false"):
        read_layout(root)


def test_setup_perms_records_shared_and_its_dry_run_does_not(
    private_root: Path, monkeypatch, capsys
):
    code, _, _ = run(capsys, "setup-perms", private_root, "--group", GROUP_NAME)
    assert code == 0
    assert read_layout(private_root)["shared"] is False

    # --apply, with every command answered as done and none run (nothing to install).
    monkeypatch.setattr(perms_ops, "require_tools", lambda recipe: None)
    layout = InstallLayout(private_root, private_root)
    result = apply_setup(
        plan_setup(layout, GROUP_NAME), layout, runner=lambda c: CommandRun(c, 0, "")
    )
    assert not result.notes
    assert read_layout(private_root)["shared"] is True
    assert root_is_shared(layout)
