"""``rootstock sync`` end to end: real uv builds of EMT-derived env files, real workers.

One install root serves the whole module. Each test first converges it to the
module's SOURCE directory (a no-op when an earlier test left it converged), then
changes one thing (an env-file edit, ``install --force``, a hotfix, a broken file)
and checks what the next sync plans and does. The env files depend on exactly what
``environments/emt.py`` does, so every build reuses the session's warm uv cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import make_root, run_rootstock
from tests.integration.checkpoint_envs import cells, hotfix, write_env

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("private_config")]

DOWNLOAD_FAILS = '''

def download(checkpoint, **kw):
    """A weights server that is down."""
    raise RuntimeError("the weights server is down")


def setup(checkpoint, device="cuda", **kw):
    """EMT scaled by SCALE."""
    return scaled_emt(SCALE)
'''

BROKEN_FILE = 'CHECKPOINTS = {"broken-1": 1}\n'  # no PEP 723 block, no setup(): fails the lint

UNRESOLVABLE = '''"""An env whose one dependency is a path that does not exist: uv fails at once."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["nothere @ file:///nonexistent/nothere"]
# ///

CHECKPOINTS = {"nothere-1": "nothere"}


def setup(checkpoint, device="cuda", **kw):
    """Never reached: the build fails."""
    raise RuntimeError("unreachable")
'''


@dataclass
class Site:
    """The module's install root and the SOURCE directory it converges to."""

    root: Path
    source: Path
    first: dict  # the --json document of the converge from empty


def sync_json(site: Site, *extra: str, source: str | Path | None = None) -> tuple[int, dict]:
    """``sync SOURCE --json --device cpu --no-push``: (exit code, document)."""
    proc = run_rootstock(
        "sync", source or site.source, "--root", site.root, "--device", "cpu", "--no-push",
        "--no-perm-check", "--json", *extra, check=False, timeout=600,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def converge(site: Site) -> None:
    """Sync the root to the module's SOURCE; whatever it had to do must succeed."""
    code, doc = sync_json(site)
    assert code == 0 and doc["ok"], doc


def planned(doc: dict) -> list[tuple[str, str, str | None]]:
    return [(i["phase"], i["env"], i["checkpoint"]) for i in doc["plan"]["items"]]


def statuses(doc: dict) -> dict[tuple[str, str, str | None], str]:
    return {(r["phase"], r["env"], r["checkpoint"]): r["status"] for r in doc["results"]}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, shared_uv_cache: Path, torch_pin) -> Site:
    base = tmp_path_factory.mktemp("sync")
    root = make_root(base / "root", shared_uv_cache)
    source = base / "source"
    write_env(source, "alpha", ["alpha-1", "alpha-2"])
    config = base / "config.toml"
    saved = os.environ.get("ROOTSTOCK_CONFIG")
    os.environ["ROOTSTOCK_CONFIG"] = str(config)  # module scope: no private_config yet
    try:
        site = Site(root, source, {})
        code, site.first = sync_json(site)
        assert code == 0, site.first
    finally:
        if saved is None:
            os.environ.pop("ROOTSTOCK_CONFIG", None)
        else:
            os.environ["ROOTSTOCK_CONFIG"] = saved
    return site


def test_converge_from_empty_builds_downloads_and_verifies(site: Site) -> None:
    doc = site.first
    assert planned(doc) == [
        ("build", "alpha", None),
        ("download", "alpha", "alpha-1"),
        ("download", "alpha", "alpha-2"),
        ("verify", "alpha", "alpha-1"),
        ("verify", "alpha", "alpha-2"),
    ]
    assert set(statuses(doc).values()) == {"done"}
    assert doc["counts"] == {"done": 5, "failed": 0, "skipped": 0} and doc["ok"] is True
    assert doc["source"]["kind"] == "dir" and doc["source"]["files"] == ["alpha.py"]
    assert (doc["cluster"], doc["device"], doc["dry_run"]) == ("testbox", "cpu", False)
    for checkpoint in ("alpha-1", "alpha-2"):
        assert cells(site.root)[("alpha", checkpoint)]["testbox"]["state"] == "verified"
    assert (site.root / "environments" / "alpha.py").read_text() == (
        site.source / "alpha.py"
    ).read_text()


def test_a_converged_install_runs_no_uv_and_spawns_no_worker(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    converge(site)
    import rootstock.install.build
    import rootstock.install.interpreters
    import rootstock.install.uv
    import rootstock.runtime.session
    import rootstock.runtime.spawn
    from rootstock.install.machine import resolve_layout
    from rootstock.ops.sources import open_source
    from rootstock.ops.sync import SyncRun, sync
    from rootstock.ops.sync_plan import SyncOptions

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a no-op sync started a process")

    for module in (rootstock.install.uv, rootstock.install.build, rootstock.install.interpreters):
        monkeypatch.setattr(module, "run_uv", refuse)
    for module in (rootstock.runtime.spawn, rootstock.runtime.session):
        monkeypatch.setattr(module, "spawn_worker", refuse)
    monkeypatch.setattr(rootstock.runtime.spawn, "run_download", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    layout = resolve_layout(str(site.root), None, None)
    with open_source(layout, str(site.source)) as source:
        report = sync(layout, source, SyncOptions(), SyncRun(device="cpu"))
    assert report.prepared.plan.items == [] and report.results == []
    assert report.ok and report.counts() == {"done": 0, "failed": 0, "skipped": 0}


def test_a_no_op_cli_sync_exits_0_and_changes_nothing(site: Site) -> None:
    converge(site)
    manifest = (site.root / "manifest.json").read_bytes()
    generations = sorted(os.listdir(site.root / "envs"))
    proc = run_rootstock(
        "sync", site.source, "--root", site.root, "--device", "cpu", "--no-push", timeout=120
    )
    assert proc.stdout.strip() == f"nothing to do: the install matches {site.source}"
    assert (site.root / "manifest.json").read_bytes() == manifest
    assert sorted(os.listdir(site.root / "envs")) == generations


def test_an_env_file_edit_rebuilds_and_reverifies(site: Site) -> None:
    converge(site)
    before = os.path.realpath(site.root / "envs" / "alpha")
    write_env(site.source, "alpha", ["alpha-1", "alpha-2", "alpha-3"])
    code, doc = sync_json(site, "--jobs", "2", "--verify-jobs", "2")  # both pools, 2 wide
    assert code == 0, doc
    reasons = {(i["phase"], i["checkpoint"]): i["reason"] for i in doc["plan"]["items"]}
    assert reasons == {
        ("build", None): "source differs from the build (source_hash)",
        ("download", "alpha-3"): "declared, not fetched",
        ("verify", "alpha-1"): "env rebuilt by this sync",
        ("verify", "alpha-2"): "env rebuilt by this sync",
        ("verify", "alpha-3"): "newly fetched",
    }
    assert set(statuses(doc).values()) == {"done"}
    assert os.path.realpath(site.root / "envs" / "alpha") != before
    states = cells(site.root)
    assert {states[("alpha", f"alpha-{i}")]["testbox"]["state"] for i in (1, 2, 3)} == {"verified"}


def test_after_install_force_the_stale_checkpoints_are_reverified(site: Site) -> None:
    converge(site)
    run_rootstock("install", "alpha", "--root", site.root, "--force", "--no-push", timeout=600)
    assert cells(site.root)[("alpha", "alpha-1")]["testbox"]["state"] == "stale"
    code, doc = sync_json(site)
    assert code == 0, doc
    items = doc["plan"]["items"]
    assert {i["phase"] for i in items} == {"verify"}  # nothing rebuilt, nothing fetched
    assert all(i["reason"].startswith("stale: env rebuilt since verification") for i in items)
    assert len(items) == len([c for (env, _), c in cells(site.root).items() if env == "alpha"])
    assert set(statuses(doc).values()) == {"done"}


def test_a_hotfix_is_reverified_not_reverted(site: Site) -> None:
    converge(site)
    hotfix(site.root, "alpha", lambda source: source + "\n# hotfix: a comment\n")
    live = site.root / "envs" / "alpha" / "env_source.py"
    generation = os.path.realpath(site.root / "envs" / "alpha")
    code, doc = sync_json(site)
    assert code == 0, doc
    items = doc["plan"]["items"]
    assert {i["phase"] for i in items} == {"verify"} and items
    assert all("hotfix" in i["reason"] for i in items)
    assert any("hotfixed; not rebuilt" in note for note in doc["plan"]["notes"])
    assert "# hotfix: a comment" in live.read_text()
    assert os.path.realpath(site.root / "envs" / "alpha") == generation
    # Verified against the hotfix: the next sync has nothing to do but the note.
    code, again = sync_json(site)
    assert code == 0 and again["plan"]["items"] == []
    assert any("hotfixed" in note for note in again["plan"]["notes"])


def test_keep_going_past_a_broken_env_file_and_a_failed_download(
    site: Site, tmp_path: Path
) -> None:
    converge(site)
    source = tmp_path / "source"
    shutil.copytree(site.source, source)
    write_env(source, "beta", ["beta-1"])
    write_env(source, "gamma", ["gamma-1"], body=DOWNLOAD_FAILS)
    (source / "broken.py").write_text(BROKEN_FILE)
    proc = run_rootstock(
        "sync", source, "--root", site.root, "--device", "cpu", "--no-push", "--no-perm-check",
        check=False, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The worker's traceback is the failed download's output, indented under its line;
    # rootstock's own would start a line.
    own = [line for line in proc.stderr.splitlines() if line.startswith("Traceback")]
    assert not own, proc.stderr
    lines = proc.stdout.splitlines()
    assert "sync: 4 done, 2 failed, 1 skipped" in lines
    failed = lines.index("failed:")
    assert lines[failed + 1].startswith(f"  build broken: {source / 'broken.py'} fails the")
    assert lines[failed + 2].startswith("  download gamma/gamma-1: ")
    assert "the weights server is down" in lines[failed + 2]
    assert lines[-1] == "  hint: re-run the same sync after fixing; completed work is skipped"
    assert "skip verify gamma/gamma-1: the download of gamma/gamma-1 failed" in proc.stderr
    # The failure's output (the lint problems) is shown; a success's never is.
    assert "no top-level setup() function" in proc.stderr
    assert cells(site.root)[("beta", "beta-1")]["testbox"]["state"] == "verified"
    assert cells(site.root)[("gamma", "gamma-1")]["testbox"]["state"] == "not fetched"


def test_a_failed_build_says_its_failure_once(scratch_root: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "nothere.py").write_text(UNRESOLVABLE)
    (source / "broken.py").write_text(BROKEN_FILE)
    proc = run_rootstock(
        "sync", source, "--root", scratch_root, "--device", "cpu", "--no-push",
        "--no-perm-check", env={"UV_OFFLINE": "1"}, check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    # The one-line cause once, in the summary; under the progress line only the rest.
    headline = "uv failed while installing nothere's packages (exit code 1)"
    assert said.count(headline) == 1, said
    assert f"  build nothere: {headline}: error: Distribution not found" in proc.stdout
    lint = f"{source / 'broken.py'} fails the install lint"
    assert said.count(lint) == 1 and f"  build broken: {lint}" in proc.stdout
    assert said.count("no top-level setup() function") == 1
    progress = proc.stderr.splitlines()
    failed = [line for line in progress if " FAIL build " in line]
    assert len(failed) == 2 and all(line.endswith(" s)") for line in failed), progress
    assert "    --- output (last lines) ---" in progress
    assert "skip download nothere/nothere-1: the build of nothere failed" in proc.stderr


def test_a_journal_an_interrupted_prune_left_is_finished_first(site: Site) -> None:
    converge(site)
    from rootstock.install.machine import resolve_layout
    from rootstock.install.prune_journal import PruneJournal, write_journal

    layout = resolve_layout(str(site.root), None, None)
    stray = layout.cache_root / "cache" / "stray-weights.bin"
    stray.write_bytes(b"weights no record names")
    write_journal(layout, PruneJournal(files=["cache/stray-weights.bin"]))
    code, dry = sync_json(site, "--dry-run")
    assert code == 0 and dry["pending_prune"] is None and stray.exists()
    assert any("an interrupted prune left a journal" in note for note in dry["plan"]["notes"])
    code, doc = sync_json(site)
    assert code == 0, doc
    assert doc["pending_prune"] == {"deleted": ["cache/stray-weights.bin"], "spared": []}
    assert not stray.exists() and not layout.prune_journal.exists()
    assert doc["plan"]["items"] == []  # the install itself was converged all along


def test_dry_run_prints_the_plan_and_changes_nothing(site: Site, tmp_path: Path) -> None:
    converge(site)
    source = tmp_path / "source"
    shutil.copytree(site.source, source)
    write_env(source, "delta", ["delta-1"])
    manifest = (site.root / "manifest.json").read_bytes()
    proc = run_rootstock(
        "sync", source, "--root", site.root, "--device", "cpu", "--dry-run", timeout=120
    )
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        f"sync plan for {source} (cluster testbox, device cpu); "
        "dry run: nothing is built, fetched or verified"
    )
    assert "+ build delta (not built)" in lines
    assert "+ download delta/delta-1 (declared, not fetched)" in lines
    assert "~ verify delta/delta-1 (newly fetched)" in lines
    assert lines[-1] == "Plan: 1 to build, 1 to download, 1 to verify."
    code, doc = sync_json(site, "--dry-run", source=source)
    assert code == 0
    assert set(doc) == {
        "source", "cluster", "device", "dry_run", "pending_prune", "plan", "results", "counts",
        "ok",
    }  # fmt: skip
    assert doc["dry_run"] is True and doc["results"] == [] and doc["ok"] is True
    assert set(doc["plan"]) == {"items", "notes", "counts"}
    assert doc["plan"]["counts"] == {"build": 1, "download": 1, "verify": 1}
    assert set(doc["plan"]["items"][0]) == {
        "phase", "env", "checkpoint", "reason", "path", "blocked",
    }  # fmt: skip
    assert (site.root / "manifest.json").read_bytes() == manifest
    assert not (site.root / "envs" / "delta").exists()


def test_unknown_env_is_a_usage_error_with_a_close_match(site: Site) -> None:
    proc = run_rootstock(
        "sync", site.source, "--root", site.root, "--env", "alpah", "--dry-run",
        check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown env 'alpah'" in proc.stderr and "close matches: alpha" in proc.stderr


def test_an_empty_source_is_an_error_not_nothing_declared(site: Site, tmp_path: Path) -> None:
    proc = run_rootstock("sync", tmp_path, "--root", site.root, check=False, timeout=120)
    assert proc.returncode == 1
    assert "holds no env files" in proc.stderr


def test_a_git_source_by_tag_and_by_branch(site: Site, tmp_path: Path) -> None:
    converge(site)
    repo = tmp_path / "repo"
    (repo / "envs").mkdir(parents=True)
    shutil.copyfile(site.source / "alpha.py", repo / "envs" / "alpha.py")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org"]

    def run_git(*args: str) -> None:
        subprocess.run([*git, *args], check=True, capture_output=True, timeout=60)

    run_git("init", "-q", "-b", "main")
    run_git("add", "envs")
    run_git("commit", "-q", "-m", "alpha as installed")
    run_git("tag", "v1")
    write_env(repo / "envs", "alpha", ["alpha-1", "alpha-2", "alpha-3", "alpha-4"])
    run_git("commit", "-q", "-am", "alpha serves alpha-4")
    url = f"git+file://{repo}"
    proc = run_rootstock(
        "sync", f"{url}@v1#subdirectory=envs", "--root", site.root, "--device", "cpu",
        "--no-push", timeout=300,
    )  # fmt: skip
    assert proc.stdout.strip() == f"nothing to do: the install matches {url}@v1#subdirectory=envs"
    code, doc = sync_json(site, "--dry-run", source=f"{url}@main#subdirectory=envs")
    assert code == 0
    assert doc["source"]["kind"] == "git" and len(doc["source"]["revision"]) == 40
    assert ("build", "alpha", None) in planned(doc)
    assert ("download", "alpha", "alpha-4") in planned(doc)


def test_without_source_the_registered_env_files_are_the_source(site: Site) -> None:
    converge(site)
    proc = run_rootstock(
        "sync", "--root", site.root, "--device", "cpu", "--dry-run", "--json", timeout=120
    )
    doc = json.loads(proc.stdout)
    assert doc["source"]["kind"] == "registered"
    assert doc["source"]["directory"] == str(site.root / "environments")
    assert "alpha.py" in doc["source"]["files"]
    assert not [i for i in doc["plan"]["items"] if i["env"] == "alpha"]
