"""A built ``env_source.py`` that no longer parses is loud in every command.

One real root per module: the sample EMT env plus a second scaled-EMT env
("other"), both built by real uv and fetched. "other" is then hotfixed with a
syntax error, the way a maintainer's bad in-place edit would leave it. ``status``
and ``list`` must show it ``broken`` with ``file:line: message``, ``smoke-test``
must count its fetched checkpoint as failed (exit 1) while still verifying EMT,
and ``add`` must name the parse error instead of "unknown checkpoint".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import ENVIRONMENTS, installed_root, run_rootstock
from tests.integration.checkpoint_envs import (
    cells,
    hotfix,
    smoke_json,
    status_json,
    write_env,
)

pytestmark = pytest.mark.timeout(600)

# Line 13 of the written env is "SCALE = 1.0" (see checkpoint_envs.ENV_HEADER).
BROKEN_LINE = 13


def rs(root: Path, *args: str, check: bool = False, timeout: float = 300):
    return run_rootstock(*args, "--root", root, check=check, timeout=timeout)


@pytest.fixture(scope="module")
def broken_root(tmp_path_factory, shared_uv_cache: Path) -> tuple[Path, str]:
    """EMT and "other" built and fetched, then "other" broken; returns (root, location)."""
    base = tmp_path_factory.mktemp("broken-env")
    other = write_env(base / "src", "other", ["other-emt"])
    root = installed_root(base / "root", shared_uv_cache, [ENVIRONMENTS / "emt.py", other])
    rs(root, "add", "emt", "--no-verify", check=True)
    rs(root, "add", "other-emt", "--device", "cpu", check=True)
    hotfix(root, "other", lambda src: src.replace("SCALE = 1.0", "SCALE = (1.0", 1))
    live = root / "envs" / "other" / "env_source.py"
    assert live.read_text().splitlines()[BROKEN_LINE - 1] == "SCALE = (1.0"
    return root, f"{live}:{BROKEN_LINE}: syntax error: "


def test_status_and_list_show_the_env_broken_with_file_and_line(broken_root):
    root, location = broken_root
    doc = status_json(root)
    rows = {env["name"]: env for env in doc["envs"]}
    other = rows["other"]
    assert other["state"] == "broken"
    assert other["error"].startswith(location), other["error"]
    assert "was never closed" in other["error"]
    assert rows["emt"]["state"] == "built" and rows["emt"]["error"] is None
    # Its rows are the ids the manifest recorded from the last good parse.
    assert [row["id"] for row in other["checkpoints"]] == ["other-emt"]
    assert any(location in line for line in doc["warnings"])

    human = rs(root, "status")
    assert human.returncode == 0, human.stderr
    assert "broken" in human.stdout
    assert f"env 'other' is broken: {location}" in human.stderr

    listing = json.loads(rs(root, "list", "--json", check=True).stdout)
    listed = {env["name"]: env for env in listing["envs"]}
    assert listed["other"]["error"].startswith(location)
    assert listed["other"]["checkpoints"] == ["other-emt"]
    assert listed["emt"]["error"] is None and listed["emt"]["checkpoints"] == ["emt"]
    human = rs(root, "list")
    assert human.returncode == 0 and "broken" in human.stdout
    assert f"env 'other' is broken: {location}" in human.stderr


def test_add_names_the_parse_error(broken_root):
    root, location = broken_root
    before = (root / "manifest.json").read_bytes()
    proc = rs(root, "add", "other-emt", "--device", "cpu")
    assert proc.returncode == 1, proc.stderr
    assert "unknown checkpoint" not in proc.stderr
    assert "env 'other'" in proc.stderr and "is broken" in proc.stderr
    assert location in proc.stderr
    assert "rootstock install other --force" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (root / "manifest.json").read_bytes() == before

    # An id nobody declares is still a typo (2), but the hint names the broken env,
    # which might have declared it.
    proc = rs(root, "add", "other-emt2", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert "close matches: other-emt" in proc.stderr
    assert "env 'other' is broken" in proc.stderr and location in proc.stderr


def test_smoke_test_counts_the_broken_env_as_failed(broken_root):
    root, location = broken_root
    # --env/--checkpoint of the broken env are accepted, not typos.
    code, summary = smoke_json(root, "--env", "other")
    assert code == 1 and summary["counts"] == {"failed": 1}
    code, summary = smoke_json(root, "--checkpoint", "other-emt")
    assert code == 1 and summary["counts"] == {"failed": 1}
    proc = rs(root, "smoke-test", "--device", "cpu", "--env", "emt", "--checkpoint", "other-emt")
    assert proc.returncode == 2 and "served by env 'other', not 'emt'" in proc.stderr

    code, summary = smoke_json(root)
    assert code == 1 and summary["ok"] is False
    assert summary["counts"] == {"failed": 1, "verified": 1}
    results = {r["checkpoint"]: r for r in summary["results"]}
    assert results["emt"]["state"] == "verified"
    failed = results["other-emt"]
    assert (failed["env"], failed["state"], failed["device"]) == ("other", "failed", "cpu")
    assert failed["message"].startswith(location), failed["message"]

    # The stamp is in the manifest, so status shows the failure, not "stale".
    state = cells(root)[("other", "other-emt")]["testbox"]
    assert state["state"] == "failed" and state["message"].startswith(location)

    human = rs(root, "smoke-test", "--device", "cpu", "--env", "other")
    assert human.returncode == 1
    assert re.search(r"FAIL other-emt \(other\) failed on cpu", human.stdout), human.stdout
