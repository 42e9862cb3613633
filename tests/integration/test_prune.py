"""``rootstock prune`` on a real install: envs built by real uv, a real running worker.

One root per module, with a private uv cache of its own (``uv cache prune`` must
never touch the session's shared cache), holding the sample EMT env and ``emtb``
(EMT under two checkpoint ids). The read-only tests come first; each test that
prunes ``emtb`` rebuilds it first if an earlier one removed it, so every test also
runs on its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import load_manifest, record_fetch, update_manifest
from rootstock.install.prune_journal import PruneJournal, write_journal
from tests.conftest import ENVIRONMENTS, copy_env, make_root, run_rootstock
from tests.integration.checkpoint_envs import reap_workers, write_env

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("private_config")]

DAY = 24 * 3600.0


@pytest.fixture(scope="module")
def declared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The env files of the install: emt.py and emtb.py."""
    src = tmp_path_factory.mktemp("declared")
    copy_env(ENVIRONMENTS / "emt.py", src)
    write_env(src, "emtb", ["b1", "b2"])
    return src


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, declared: Path, torch_pin) -> Path:
    base = tmp_path_factory.mktemp("prune")
    private_cache = base / "uv-cache"
    private_cache.mkdir()
    made = make_root(base / "root", private_cache)
    for env_file in sorted(declared.glob("*.py")):
        install(made, env_file)
    return made


@pytest.fixture
def emt_only(tmp_path: Path, root: Path) -> Path:
    """A SOURCE that no longer declares emtb."""
    src = tmp_path / "emt-only"
    src.mkdir()
    shutil.copyfile(root / "environments" / "emt.py", src / "emt.py")
    return src


def install(root: Path, env_file: Path, *extra: str) -> None:
    run_rootstock("install", env_file, "--root", root, "--no-push", "--no-perm-check", *extra)


def ensure_emtb(root: Path, declared: Path) -> Path:
    """emtb built (again, if an earlier test pruned it); its live generation."""
    if not (root / "envs" / "emtb" / "env_source.py").is_file():
        install(root, declared / "emtb.py")
    return Path(os.path.realpath(root / "envs" / "emtb"))


def prune(root: Path, *args: str, check: bool = True):
    return run_rootstock("prune", *args, "--root", root, "--no-push", check=check, timeout=600)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (and the cache it links to): type, content, mode, mtime."""
    found: dict[str, tuple] = {}
    for top in (root, root / ".uv-cache"):
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                st = os.lstat(path)
                if path.is_symlink():
                    what: tuple = ("link", os.readlink(path))
                elif path.is_dir():
                    what = ("dir",)
                else:
                    what = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
                found[str(path)] = (*what, st.st_mode, st.st_mtime_ns)
    return found


def perm_problems(root: Path) -> set[tuple[str, str]]:
    proc = run_rootstock("check-perms", root, "--json", check=False, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    return {(p["path"], p["kind"]) for p in json.loads(proc.stdout)["problems"]}


def status_ok(root: Path) -> dict:
    proc = run_rootstock("status", "--json", "--root", root, timeout=120)
    return json.loads(proc.stdout)


def make_old(path: Path, seconds: float = 2 * DAY) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


# --- read-only: nothing may change ------------------------------------------------------


def test_dry_run_and_a_refused_prompt_change_nothing(
    root: Path, declared: Path, emt_only: Path
) -> None:
    ensure_emtb(root, declared)
    before = snapshot(root)

    dry = prune(root, str(emt_only), "--dry-run", "--deep", "--min-age", "0")
    assert "dry run: nothing is deleted" in dry.stdout
    assert "env emtb" in dry.stdout and "plan: 1 env" in dry.stdout

    as_json = json.loads(prune(root, str(emt_only), "--dry-run", "--json").stdout)
    assert set(as_json) == {
        "dry_run",
        "plan",
        "results",
        "finished_journal",
        "reclaimed_bytes",
        "ok",
    }
    assert as_json["dry_run"] is True and as_json["results"] == []
    entry = next(e for e in as_json["plan"]["entries"] if e["kind"] == "env")
    assert set(entry) == {"kind", "name", "env", "reason", "bytes", "paths", "shared", "count"}
    assert entry["name"] == "emtb" and entry["bytes"] > 0
    assert "environments/emtb.py" in entry["paths"]

    # No terminal and no --yes: refused as a usage error that says how to see the plan.
    refused = prune(root, str(emt_only), "--min-age", "0", check=False)
    assert refused.returncode == 2, refused.stderr
    assert "--dry-run" in refused.stderr and "--yes" in refused.stderr

    assert snapshot(root) == before


def answer_prompt(root: Path, source: Path, answer: bytes) -> tuple[int, str]:
    """Run ``prune SOURCE --min-age 0`` on a terminal (a pty) and type ``answer`` at its prompt."""
    import select
    import subprocess

    from tests.conftest import ROOTSTOCK

    controller, terminal = os.openpty()
    proc = subprocess.Popen(
        [*ROOTSTOCK, "prune", str(source), "--root", str(root), "--min-age", "0", "--no-push"],
        stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True,
    )  # fmt: skip
    os.close(terminal)
    output, answered = b"", False
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # the terminal closed: the command is done
                    break
                if not chunk:
                    break
                output += chunk
            if not answered and b"Delete all of this?" in output:
                os.write(controller, answer + b"\n")
                answered = True
        return proc.wait(timeout=60), output.decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        os.close(controller)


def test_on_a_terminal_prune_asks_and_a_no_deletes_nothing(
    root: Path, declared: Path, emt_only: Path
) -> None:
    ensure_emtb(root, declared)
    before = snapshot(root)
    code, output = answer_prompt(root, emt_only, b"n")
    assert "prune plan" in output and "env emtb" in output, output
    assert "aborted: nothing was pruned" in output
    assert code == 1
    assert snapshot(root) == before


def test_a_bad_source_prunes_nothing(
    root: Path, declared: Path, emt_only: Path, tmp_path: Path
) -> None:
    ensure_emtb(root, declared)
    empty = tmp_path / "empty"
    empty.mkdir()
    failing = tmp_path / "failing"
    shutil.copytree(emt_only, failing)
    (failing / "other.py").write_text("CHECKPOINTS = {'x': None}\n")  # no script block, no setup()
    before = snapshot(root)
    for source, why in [
        (tmp_path / "missing", "does not exist"),
        (empty, "holds no env files"),
        (failing, "fail the lint"),
    ]:
        proc = prune(root, str(source), "--yes", "--min-age", "0", "--deep", check=False)
        assert proc.returncode == 1, (source, proc.stdout, proc.stderr)
        assert why in proc.stderr and "Traceback" not in proc.stderr
        assert snapshot(root) == before, source


# --- pruning ------------------------------------------------------------------------------


def test_deep_deletes_only_what_no_record_lists(root: Path) -> None:
    layout = InstallLayout(root, root)
    stray = root / "cache" / "stray-library" / "weights.bin"
    kept = root / "cache" / "emt-weights" / "kept.bin"
    for path in (stray, kept):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(20000))
        make_old(path)
    record_fetch(layout, "emt", "emt", files=["cache/emt-weights/kept.bin"])

    shallow = prune(root, "--yes", "--min-age", "0")
    assert "cache/stray-library (1 files" in shallow.stdout
    assert "deleted only with --deep" in shallow.stdout
    assert stray.exists()

    deep = prune(root, "--yes", "--deep", "--min-age", "0")
    assert "deleted unattributed cache/stray-library" in deep.stdout
    assert not stray.exists() and kept.read_bytes()
    status_ok(root)


def test_old_generations_wait_for_min_age(root: Path) -> None:
    before = Path(os.path.realpath(root / "envs" / "emt"))
    install(root, root / "environments" / "emt.py", "--force")
    assert Path(os.path.realpath(root / "envs" / "emt")) != before and before.is_dir()

    young = prune(root, "--yes")
    assert "younger than --min-age" in young.stdout and "nothing to prune" in young.stdout
    assert before.is_dir()

    collected = prune(root, "--yes", "--min-age", "0")
    assert f"deleted generation envs/{before.name}" in collected.stdout
    assert not before.exists() and (root / "envs" / "emt" / "env_source.py").is_file()
    status_ok(root)


def test_a_generation_in_use_is_spared_until_its_worker_exits(
    root: Path, declared: Path, emt_only: Path
) -> None:
    from ase.build import bulk

    from rootstock import RootstockCalculator

    generation = ensure_emtb(root, declared)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    calc = RootstockCalculator(root=root, checkpoint="b1", device="cpu")
    try:
        atoms.calc = calc
        first = atoms.get_potential_energy()

        pruned = prune(root, str(emt_only), "--yes", "--min-age", "0")
        assert "spared env emtb" in pruned.stdout, pruned.stdout
        assert generation.is_dir() and not (root / "envs" / "emtb").is_symlink()
        assert "emtb" not in load_manifest(InstallLayout(root, root))["envs"]

        atoms.positions[0] += 0.05  # a new calculation: the same worker, still running
        assert atoms.get_potential_energy() != first
        again = prune(root, "--dry-run", "--min-age", "0")
        assert f"keep generation envs/{generation.name}: in use" in again.stdout
    finally:
        calc.close()
        reap_workers(root, grace_s=10)

    collected = prune(root, "--yes", "--min-age", "0")
    assert f"deleted generation envs/{generation.name}" in collected.stdout
    assert not generation.exists()
    status_ok(root)


def test_an_env_removed_from_source_goes_with_its_records_and_files(
    root: Path, declared: Path, emt_only: Path
) -> None:
    generation = ensure_emtb(root, declared)
    layout = InstallLayout(root, root)
    files = {"cache/w/shared.bin": b"s" * 4096, "cache/w/b1.bin": os.urandom(50000)}
    for relative, data in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    record_fetch(layout, "emtb", "b1", files=sorted(files))
    record_fetch(layout, "emt", "emt", files=["cache/w/shared.bin"])
    perms_before = perm_problems(root)

    proc = prune(root, str(emt_only), "--yes", "--min-age", "0", "--json")
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["dry_run"] is False
    statuses = {(r["kind"], r["name"]): r["status"] for r in report["results"]}
    assert statuses[("env", "emtb")] == "deleted"
    assert statuses[("checkpoint", "b1")] == "deleted"
    assert report["reclaimed_bytes"] >= 50000

    assert not (root / "envs" / "emtb").is_symlink() and not generation.exists()
    assert not list((root / "envs").glob(".emtb.*"))
    assert not (root / "environments" / "emtb.py").exists()
    assert not (root / "environments" / "emtb.py.lock").exists()
    assert not (root / "cache/w/b1.bin").exists()
    assert (root / "cache/w/shared.bin").read_bytes() == files["cache/w/shared.bin"]
    manifest = load_manifest(layout)
    assert "emtb" not in manifest["envs"] and "emt" in manifest["envs"]
    assert (root / "envs" / "emt" / "env_source.py").is_file()
    assert not (root / ".prune-journal.json").exists()

    assert [e["name"] for e in status_ok(root)["envs"]] == ["emt"]
    assert perm_problems(root) <= perms_before
    assert "nothing to prune" in prune(root, str(emt_only), "--yes", "--min-age", "0").stdout


def test_the_journal_of_a_killed_prune_is_finished_by_the_next(root: Path, declared: Path) -> None:
    generation = ensure_emtb(root, declared)
    layout = InstallLayout(root, root)
    owed = root / "cache" / "owed.bin"
    owed.write_bytes(b"o" * 1000)
    record_fetch(layout, "emtb", "b2", files=["cache/owed.bin"])

    def step_one(data):  # what a prune killed right after its transaction had done
        data["envs"].pop("emtb")
        write_journal(
            layout,
            PruneJournal(
                ["cache/owed.bin"], ["emtb"], ["environments/emtb.py", "environments/emtb.py.lock"]
            ),
        )

    update_manifest(layout, step_one)
    status_ok(root)  # the install is valid in between

    plan = prune(root, "--dry-run")
    assert "an interrupted prune left a journal" in plan.stdout

    finished = prune(root, "--yes")
    assert "finished an interrupted prune" in finished.stdout
    assert not owed.exists() and not generation.exists()
    assert not (root / "envs" / "emtb").is_symlink()
    assert not (root / "environments" / "emtb.py").exists()
    assert not (root / ".prune-journal.json").exists()
    status_ok(root)
    assert "nothing to prune" in prune(root, "--yes").stdout
